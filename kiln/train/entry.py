"""The command line of every training job: the job file's task picks the stage, the Trainer runs it.

One process:   python -m kiln.train --config job.json        (task pretrain, sft, dpo, rl, reward or ppo)
Several:       python -m torch.distributed.run --nproc_per_node=2 -m kiln.train --config job.json
Several nodes: torchrun --nnodes=2 --node_rank=R --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT -m kiln.train ...
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

import torch.distributed as dist

# job task -> the module whose main() runs it
TASKS = {"pretrain": "kiln.train.loop", "sft": "kiln.train.loop", "dpo": "kiln.posttrain.dpo", "rl": "kiln.posttrain.rl",
         "reward": "kiln.posttrain.reward", "ppo": "kiln.posttrain.ppo"}


def entry_point(argv: list[str]) -> Callable[..., dict[str, Any]]:
    """The ``main`` of the module that runs the job named by ``--config`` (its ``task`` key alone is read here)."""
    path = argv[argv.index("--config") + 1] if "--config" in argv else None
    task = json.loads(Path(path).read_text()).get("task", "pretrain") if path else "pretrain"
    if task not in TASKS:
        raise ValueError(f"{path}: task {task!r} is not one of {', '.join(TASKS)}")
    return importlib.import_module(TASKS[task]).main


def run_job(job_cls, make_stage: Callable, doc: str, argv: list[str] | None, reporter=None,
            callbacks: Iterable = ()) -> dict[str, Any]:
    """Parse the command line, join the process group, broadcast the job, build its stage and train it."""
    from kiln.train.dist import broadcast_config, setup_distributed
    from kiln.train.telemetry import PrintReporter
    from kiln.train.trainer import Trainer

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help=f"job JSON file ({job_cls.__name__} fields), read by rank 0")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (the same on every rank)")
    parser.add_argument("--timeout-s", type=int, default=600, help="process-group timeout in seconds")
    args = parser.parse_args(argv)
    info = setup_distributed(args.device, args.timeout_s)
    try:
        job = broadcast_config(job_cls, args.config, info)
        if job.layout.tp > 1 or job.layout.pp > 1:  # before the stage takes its slice of the data: a tensor-parallel
            job.check_layout("job", info.world_size)  # group, and the stages of a pipeline, share one
            info = dataclasses.replace(info, tp=job.layout.tp, pp=job.layout.pp)
        return Trainer(job, make_stage(job, info), info, reporter or PrintReporter(), callbacks).fit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None, reporter=None, callbacks: Iterable = ()) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    return entry_point(argv)(argv, reporter, callbacks)


if __name__ == "__main__":
    from kiln.train.preempt import exit_code

    sys.exit(exit_code(main()))
