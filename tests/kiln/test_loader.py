"""Tests for kiln.loader: determinism, disjoint rank slices, exact resume (same/different world size), epoch wrap, eval windows.

Run: python -m pytest tests/kiln/test_loader.py -q
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.loader import TokenLoader, iter_eval_batches
from kiln.shards import shard_header

T = 16


def write_stream(tmp_path: Path, sizes: list[int]) -> list[Path]:
    """Shards whose concatenated tokens are 0, 1, 2, ...: token value = stream position."""
    paths, start = [], 0
    for i, n in enumerate(sizes):
        p = tmp_path / f"train_{i:06d}.bin"
        p.write_bytes(shard_header(n, np.dtype("<u2")) + np.arange(start, start + n, dtype="<u2").tobytes())
        paths.append(p)
        start += n
    return paths


@pytest.fixture
def paths(tmp_path: Path) -> list[Path]:
    return write_stream(tmp_path, [1000, 37, 1, 611])  # 1649 tokens -> 103 windows of 16+1, some span shards


def windows_of(x: torch.Tensor) -> list[int]:
    return (x[:, 0] // T).tolist()


def test_batches_are_windows(paths: list[Path]) -> None:
    loader = TokenLoader(paths, 4, T, seed=1)
    assert loader.stream.n_windows == 103 and loader.batches_per_epoch == 25
    seen = []
    for _ in range(loader.batches_per_epoch):
        x, y = loader.next_batch()
        assert x.shape == y.shape == (4, T) and x.dtype == y.dtype == torch.int64
        w = torch.tensor(windows_of(x))
        assert torch.equal(x, w[:, None] * T + torch.arange(T)) and torch.equal(y, x + 1)
        seen += w.tolist()
    assert seen == np.random.default_rng([1, 0]).permutation(103)[:100].tolist()  # one epoch, no repeats
    x, _ = loader.next_batch()  # wraps: 3 leftover windows skipped, new permutation
    assert loader.epoch == 1 and windows_of(x) == np.random.default_rng([1, 1]).permutation(103)[:4].tolist()


def test_determinism_by_seed(paths: list[Path]) -> None:
    a, b, c = TokenLoader(paths, 4, T, seed=7), TokenLoader(paths, 4, T, seed=7), TokenLoader(paths, 4, T, seed=8)
    xa = [a.next_batch()[0] for _ in range(30)]
    assert all(torch.equal(p, b.next_batch()[0]) for p in xa)
    assert not all(torch.equal(p, c.next_batch()[0]) for p in xa)


def test_ranks_are_disjoint_and_cover_global_batch(paths: list[Path]) -> None:
    ranks = [TokenLoader(paths, 2, T, rank=r, world_size=3, seed=3) for r in range(3)]
    single = TokenLoader(paths, 6, T, seed=3)
    for _ in range(40):  # crosses epoch boundaries (17 batches per epoch)
        parts = [windows_of(r.next_batch()[0]) for r in ranks]
        flat = sum(parts, [])
        assert len(set(flat)) == 6 and flat == windows_of(single.next_batch()[0])


def test_resume_same_world_size(paths: list[Path]) -> None:
    loader = TokenLoader(paths, 4, T, seed=2)
    for _ in range(23):
        loader.next_batch()
    state = loader.state_dict()
    assert state == {"epoch": 0, "batch": 23, "window": 92, "seed": 2, "global_batch": 4, "seq_len": T, "n_windows": 103}
    assert all(type(v) is int for v in state.values())
    expected = [loader.next_batch() for _ in range(5)]  # crosses into epoch 1
    fresh = TokenLoader(paths, 4, T, seed=99)
    fresh.load_state_dict(state)
    for x, y in expected:
        fx, fy = fresh.next_batch()
        assert torch.equal(fx, x) and torch.equal(fy, y)
    assert fresh.state_dict() == loader.state_dict() and fresh.epoch == 1


@pytest.mark.parametrize("new_b,new_w", [(8, 1), (2, 4), (1, 8)])
def test_resume_on_another_world_size(paths: list[Path], new_b: int, new_w: int) -> None:
    old = [TokenLoader(paths, 4, T, rank=r, world_size=2, seed=5) for r in range(2)]
    for _ in range(9):
        for r in old:
            r.next_batch()
    state = old[0].state_dict()  # same on every rank
    assert state == old[1].state_dict()
    expected = [torch.cat([r.next_batch()[0] for r in old]) for _ in range(6)]  # 8 windows per global batch
    new = [TokenLoader(paths, new_b, T, rank=r, world_size=new_w) for r in range(new_w)]
    for r in new:
        r.load_state_dict(state)
    for x in expected:
        assert torch.equal(torch.cat([r.next_batch()[0] for r in new]), x)


def test_resume_with_other_global_batch_continues_window_position(paths: list[Path]) -> None:
    loader = TokenLoader(paths, 4, T, seed=4)
    used = [w for _ in range(5) for w in windows_of(loader.next_batch()[0])]
    bigger = TokenLoader(paths, 6, T)
    bigger.load_state_dict(loader.state_dict())
    nxt = windows_of(bigger.next_batch()[0])
    assert nxt == np.random.default_rng([4, 0]).permutation(103)[20:26].tolist() and not set(nxt) & set(used)


def test_state_mismatch_and_too_few_tokens(paths: list[Path], tmp_path: Path) -> None:
    state = TokenLoader(paths, 4, T).state_dict()
    with pytest.raises(ValueError, match="seq_len=16 but this loader has 8"):
        TokenLoader(paths, 4, 8).load_state_dict(state)
    with pytest.raises(ValueError, match=r"4 shards hold 1649 tokens = 103 windows.*16 x 8 ranks x 16 tokens needs 128 windows"):
        TokenLoader(paths, 16, T, rank=0, world_size=8)
    with pytest.raises(ValueError, match="rank"):
        TokenLoader(paths, 4, T, rank=2, world_size=2)


def test_eval_batches(paths: list[Path], tmp_path: Path) -> None:
    batches = list(iter_eval_batches(paths, 10, T))
    assert len(batches) == 11 and batches[-1][0].shape == (3, T)
    all_x = torch.cat([x for x, _ in batches])
    assert torch.equal(all_x, torch.arange(103 * T).view(103, T))
    assert torch.equal(torch.cat([y for _, y in batches]), all_x + 1)
    again = list(iter_eval_batches(paths, 10, T, max_batches=2))
    assert len(again) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(again, batches))
    (tmp_path / "short").mkdir()
    short = write_stream(tmp_path / "short", [T])  # 16 tokens < one window of 17
    with pytest.raises(ValueError, match="too short"):
        next(iter_eval_batches(short, 2, T))
