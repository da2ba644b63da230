"""Tests for kiln.tokens.loader: determinism, disjoint ranks, exact resume, resume on other world sizes counting every token, eval windows.

Run: python -m pytest tests/kiln/tokens/test_loader.py -q
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.tokens.loader import TokenLoader, iter_eval_batches
from kiln.tokens.shards import ShardError, shard_header, shard_paths, write_shards

T = 16
N_WINDOWS = 103  # (1649 - 1) // 16


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


def assert_epochs_cover_every_token(xs: list[torch.Tensor], n_epochs: int) -> None:
    """Split the rows read (in order) into epochs of N_WINDOWS rows: each epoch has every input token exactly once."""
    rows = torch.cat(xs)  # (windows read, T)
    assert len(rows) >= n_epochs * N_WINDOWS
    for e in range(n_epochs):
        epoch = rows[e * N_WINDOWS:(e + 1) * N_WINDOWS]
        counts = np.bincount(epoch.flatten().numpy(), minlength=N_WINDOWS * T)
        assert len(counts) == N_WINDOWS * T and (counts == 1).all(), f"epoch {e}: tokens skipped or repeated"
        assert windows_of(epoch) != sorted(windows_of(epoch))  # shuffled, not read in stream order


def test_batches_are_windows_and_epochs_run_on(paths: list[Path]) -> None:
    loader = TokenLoader(paths, 4, T, seed=1)
    assert loader.stream.n_windows == N_WINDOWS and loader.stream.n_tokens == 1649
    xs = []
    for _ in range(60):  # 240 windows: two epochs and a bit
        x, y = loader.next_batch()
        assert x.shape == y.shape == (4, T) and x.dtype == y.dtype == torch.int64
        w = torch.tensor(windows_of(x))
        assert torch.equal(x, w[:, None] * T + torch.arange(T)) and torch.equal(y, x + 1)
        xs.append(x)
    assert_epochs_cover_every_token(xs, 2)
    seq = [w for x in xs for w in windows_of(x)]
    assert seq[:N_WINDOWS] == np.random.default_rng([1, 0]).permutation(N_WINDOWS).tolist()
    assert seq[N_WINDOWS:2 * N_WINDOWS] == np.random.default_rng([1, 1]).permutation(N_WINDOWS).tolist()
    assert (loader.epoch, loader.window) == (2, 240 - 2 * N_WINDOWS)


def test_determinism_by_seed(paths: list[Path]) -> None:
    a, b, c = TokenLoader(paths, 4, T, seed=7), TokenLoader(paths, 4, T, seed=7), TokenLoader(paths, 4, T, seed=8)
    xa = [a.next_batch()[0] for _ in range(30)]
    assert all(torch.equal(p, b.next_batch()[0]) for p in xa)
    assert not all(torch.equal(p, c.next_batch()[0]) for p in xa)


def test_two_ranks_are_disjoint_and_make_up_the_global_batch(paths: list[Path]) -> None:
    ranks = [TokenLoader(paths, 5, T, rank=r, world_size=2, seed=3) for r in range(2)]
    single = TokenLoader(paths, 10, T, seed=3)
    per_rank: list[list[int]] = [[], []]
    xs = []
    for _ in range(10):  # 100 of the 103 windows of epoch 0
        parts = [r.next_batch()[0] for r in ranks]
        w0, w1 = windows_of(parts[0]), windows_of(parts[1])
        assert not set(w0) & set(w1)
        assert torch.equal(torch.cat(parts), single.next_batch()[0])
        per_rank[0] += w0
        per_rank[1] += w1
        xs += parts
    assert not set(per_rank[0]) & set(per_rank[1]) and len(set(per_rank[0] + per_rank[1])) == 100
    for _ in range(11):  # into epoch 1 and on to the end of epoch 2
        xs += [r.next_batch()[0] for r in ranks]
    assert_epochs_cover_every_token(xs, 2)


def test_exact_resume_same_world_size(paths: list[Path]) -> None:
    loader = TokenLoader(paths, 4, T, seed=2)
    for _ in range(23):
        loader.next_batch()
    state = loader.state_dict()
    assert state == {"epoch": 0, "batch": 23, "window": 92, "seed": 2, "global_batch": 4, "seq_len": T, "n_windows": 103}
    assert all(type(v) is int for v in state.values())
    expected = [loader.next_batch() for _ in range(30)]  # on into epoch 2; batches span both epoch boundaries
    fresh = TokenLoader(paths, 4, T, seed=99)
    fresh.load_state_dict(state)
    for x, y in expected:
        fx, fy = fresh.next_batch()
        assert torch.equal(fx, x) and torch.equal(fy, y)
    assert fresh.state_dict() == loader.state_dict() and fresh.epoch == 2


@pytest.mark.parametrize("new_b,new_w", [(8, 1), (2, 4), (1, 8)])
def test_exact_resume_on_another_world_size(paths: list[Path], new_b: int, new_w: int) -> None:
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


@pytest.mark.parametrize("new_b,new_w", [(3, 3), (5, 1), (1, 7)])
def test_resume_on_other_rank_count_neither_skips_nor_repeats_a_token(paths: list[Path], new_b: int, new_w: int) -> None:
    """2 ranks x 4 for 7 steps, then a restart with another number of ranks (another global batch) to the end of epoch 1."""
    old = [TokenLoader(paths, 4, T, rank=r, world_size=2, seed=11) for r in range(2)]
    xs = [r.next_batch()[0] for _ in range(7) for r in old]  # 56 windows, in rank order within each step
    state = old[0].state_dict()
    new = [TokenLoader(paths, new_b, T, rank=r, world_size=new_w, seed=0) for r in range(new_w)]
    for r in new:
        r.load_state_dict(state)
    while sum(len(x) for x in xs) < 2 * N_WINDOWS:
        xs += [r.next_batch()[0] for r in new]
    assert_epochs_cover_every_token(xs, 2)
    assert new[0].state_dict() == new[-1].state_dict() and new[0].epoch == 2


def test_state_mismatch_and_bad_arguments(paths: list[Path]) -> None:
    state = TokenLoader(paths, 4, T).state_dict()
    with pytest.raises(ValueError, match="seq_len=16 but this loader has 8"):
        TokenLoader(paths, 4, 8).load_state_dict(state)
    with pytest.raises(ValueError, match="n_windows=103 but this loader has 62"):
        TokenLoader(paths[:1], 4, T).load_state_dict(state)
    with pytest.raises(ValueError, match=r"4 shards hold 1649 tokens = 103 windows.*16 x 8 ranks x 16 tokens needs 128 windows"):
        TokenLoader(paths, 16, T, rank=0, world_size=8)
    with pytest.raises(ValueError, match="rank"):
        TokenLoader(paths, 4, T, rank=2, world_size=2)
    with pytest.raises(ValueError, match="no shard files"):
        TokenLoader([], 4, T)


def test_shards_with_a_manifest_are_verified(tiny_tokenizer, docs, tmp_path: Path) -> None:
    enc, _ = tiny_tokenizer
    write_shards(enc, docs, tmp_path, 2000, 0, 1)
    train = shard_paths(tmp_path, "train")
    assert len(train) >= 3
    x, _ = TokenLoader(train, 2, T, seed=0).next_batch()
    assert (tmp_path / ".verified.json").exists()
    data = bytearray(train[1].read_bytes())
    data[-1] ^= 0xFF  # same size, new content (and modification time)
    train[1].write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"train_000001\.bin: checksum mismatch"):
        TokenLoader(train, 2, T, seed=0)
    with pytest.raises(ShardError, match=r"train_000001\.bin: checksum mismatch"):
        next(iter_eval_batches(train, 2, T))
    stray = tmp_path / "extra.bin"
    stray.write_bytes(train[0].read_bytes())
    with pytest.raises(ShardError, match=r"extra\.bin is not listed in .*manifest\.json"):
        TokenLoader([train[0], stray], 2, T)
    assert torch.equal(TokenLoader(train, 2, T, seed=0, verify=False).next_batch()[0], x)  # opt out: headers only


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
