"""Tests of kiln/train/dist.py: rank 0's config error is raised on every rank, and a CUDA rank without its GPU says so."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import torch.distributed
import torch.multiprocessing as mp

from kiln.common.config import ConfigError
from kiln.train.job import JobConfig
from kiln.train.optim import OptimConfig
from tests.ports import free_port
import pytest


def _rank(rank: int, port: int, path: str, out: str) -> None:
    from kiln.train.dist import broadcast_config, setup_distributed

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    info = setup_distributed("cpu", 60)
    try:
        broadcast_config(JobConfig, path if rank == 0 else None, info)
        result = "built"
    except ConfigError as e:
        result = str(e)
    Path(out, f"rank{rank}").write_text(result)
    torch.distributed.destroy_process_group()


def test_rank_zeros_config_error_is_raised_on_every_rank(tmp_path):
    """Only rank 0 reads and checks the job file; the other rank gets its error instead of waiting for a job."""
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"optim": {"lrr": 1}}))
    mp.start_processes(_rank, args=(free_port(), str(path), str(tmp_path)), nprocs=2, start_method="spawn")
    assert {p.name: p.read_text() for p in tmp_path.glob("rank*")} == {
        r: "job.optim: unknown key 'lrr'. Did you mean 'lr'? Allowed keys: " + ", ".join(sorted(asdict(OptimConfig())))
        + "." for r in ("rank0", "rank1")}


def test_a_cuda_rank_without_its_gpu_says_so(monkeypatch) -> None:
    from kiln.train.dist import setup_distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match="rank 1: 2 ranks per node need 2 GPUs but this machine has 1"):
        setup_distributed("cuda", 60)
