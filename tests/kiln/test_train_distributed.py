"""Tests for kiln.train under torch.distributed.run with 2 CPU processes (gloo), and rank-sharded data.

Run: python -m pytest tests/kiln/test_train_distributed.py -q   (~10 s; OMP_NUM_THREADS=1 per process)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.checkpoint import load_state, verify_checkpoint
from kiln.loader import TokenLoader
from kiln.shards import shard_paths


@pytest.mark.slow
def test_two_process_ddp_run_trains_and_reports_world_size_2(tmp_path, pretrain_job, train_runner) -> None:
    job = pretrain_job(tmp_path, max_steps=20)
    proc = train_runner(job, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = Path(json.loads(job.read_text())["out_dir"])
    res = json.loads((run / "result.json").read_text())
    assert res["world_size"] == 2 and res["steps"] == 20
    assert res["tokens"] == 20 * 4 * 32 * 2  # micro_batch x seq_len x 2 ranks per step
    assert res["final_val_loss"] < res["initial_val_loss"] - 1.0, res["history"]
    assert proc.stdout.count("step 0: val loss") == 1  # only rank 0 reports

    ckpt = run / "checkpoints" / "step_0000020"
    meta = verify_checkpoint(ckpt)
    assert meta["world_size"] == 2
    state, _ = load_state(ckpt)
    assert state["loader"]["global_batch"] == 8 and state["loader"]["window"] == 20 * 8
    rngs = state["rng"]
    assert len(rngs) == 2  # each rank's RNG is saved, and the ranks draw different dropout masks
    assert not torch.equal(rngs[0]["torch"], rngs[1]["torch"])


def test_ranks_get_disjoint_windows_that_make_up_the_single_process_batch(tiny_shards) -> None:
    paths = shard_paths(tiny_shards, "train")
    r0, r1 = (TokenLoader(paths, 4, 32, rank=r, world_size=2, seed=7) for r in (0, 1))
    single = TokenLoader(paths, 8, 32, rank=0, world_size=1, seed=7)
    for _ in range(5):
        (x0, y0), (x1, y1), (x, y) = r0.next_batch(), r1.next_batch(), single.next_batch()
        assert x0.shape == x1.shape == (4, 32)
        assert not torch.equal(x0, x1)
        rows0, rows1 = {tuple(r) for r in x0.tolist()}, {tuple(r) for r in x1.tolist()}
        assert not rows0 & rows1
        # 2 ranks x 4 windows is the same global batch as 1 rank x 8, in rank order
        assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)
        assert torch.equal(x0[:, 1:], y0[:, :-1])  # targets are the inputs shifted by one
