"""Process-group plumbing every training job shares: joining torchrun's group, one config for all ranks, rank means.

Inside a torchrun worker: ``info = setup_distributed("auto", 600); job = broadcast_config(JobConfig, path, info)``.
On one process (no torchrun) the same calls work with world size 1 and no process group.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kiln.common.config import ConfigError
from kiln.model.parallel import param_digest


@dataclass
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    tp: int = 1  # ranks that split each layer (the job's layout.tp): neighbours in rank order, fed the same data
    pp: int = 1  # pipeline stages (the job's layout.pp): the outermost mesh dim, each stage fed the same data

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """This rank's place among the data-parallel ranks (the tensor-parallel ranks of a group and the pipeline
        stages of a model copy share it)."""
        return self.rank // self.tp % self.data_world

    @property
    def data_world(self) -> int:
        """How many data-parallel ranks read disjoint batches (the world size over the tensor-parallel and pipeline
        sizes)."""
        return self.world_size // (self.tp * self.pp)


def cuda_problem(nproc_per_node: int) -> str | None:
    """Why ``nproc_per_node`` ranks cannot each have a GPU on this machine, or None when they can."""
    if not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else "no usable NVIDIA driver or GPU"
        return (f"device is cuda but torch {torch.__version__} sees no GPU here ({build}): run on a GPU machine "
                "with a CUDA build of torch, or set training_plan.hardware.device to cpu (or auto)")
    n = torch.cuda.device_count()
    if nproc_per_node > n:
        return (f"{nproc_per_node} ranks per node need {nproc_per_node} GPUs but this machine has {n}: set "
                f"training_plan.hardware.nproc_per_node to at most {n}")
    return None


def setup_distributed(device: str, timeout_s: int) -> DistInfo:
    """Join the process group torchrun set up (gloo on CPU; nccl on CUDA, with gloo beside it for CPU-side
    collectives and background checkpoint saves); a hung collective fails after ``timeout_s``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        problem = cuda_problem(local_rank + 1)
        if problem:
            raise RuntimeError(f"rank {rank}: {problem}")
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if device == "cuda" else "gloo",
                                timeout=dt.timedelta(seconds=timeout_s))
    return DistInfo(rank, local_rank, world, dev)


def broadcast_config(cls, path: str | None, info: DistInfo):
    """Rank 0 reads the job file and builds ``cls`` from it (kiln.train.job.load_job: the launcher's validated job
    rebuilt, a hand-written file validated); every
    other rank receives the built job, or rank 0's config error, which it raises too (ranks never read config
    themselves, and none waits on a rank that has failed)."""
    from kiln.train.job import load_job

    payload: list[Any] = [None]
    if info.is_main:
        try:
            payload[0] = load_job(cls, json.loads(Path(path).read_text()) if path else {}, "job")
        except ConfigError as e:
            payload[0] = e
    if info.world_size > 1:
        dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], ConfigError):
        raise payload[0]
    return payload[0]


def all_mean(values: dict[str, float], info: DistInfo) -> dict[str, float]:
    """Average a dict of floats over ranks (every rank passes the same keys); one all-reduce in float64."""
    if info.world_size == 1:
        return values
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64,
                     device=info.device if info.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return {k: v / info.world_size for k, v in zip(keys, t.tolist())}


def all_gather(value: Any, info: DistInfo) -> list[Any]:
    """Every rank's ``value`` (a picklable object), in rank order."""
    if info.world_size == 1:
        return [value]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, value)
    return out


def rank_digests(model: torch.nn.Module, info: DistInfo) -> list[str]:
    """Every rank's digest of the full parameters (replicas must agree; FSDP2 gathers each in turn)."""
    return all_gather(param_digest(model), info)
