"""The pretraining and SFT job: next-token training on token shards, or on prompt-masked instruction pairs.

One process:   python -m kiln.train --config job.json
Several:       python -m torch.distributed.run --nproc_per_node=2 -m kiln.train --config job.json
Several nodes: torchrun --nnodes=2 --node_rank=R --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT -m kiln.train ...
Rank 0 reads the job file (kiln.train.job.JobConfig) and broadcasts it, so every rank trains with the same settings.
A rerun of the same command resumes from the newest good checkpoint; a loss spike rolls back to an earlier one and
skips data. The loop itself is kiln.train.trainer.Trainer, shared with DPO and RL.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable

from kiln.train.dist import DistInfo
from kiln.train.entry import run_job
from kiln.train.job import JobConfig
from kiln.train.telemetry import Reporter
from kiln.train.trainer import Stage, Trainer


def make_stage(job: JobConfig, info: DistInfo) -> Stage:
    """The stage of a checked job (kiln.train.job.load_job): pretraining on token shards, or SFT."""
    if job.task == "pretrain":
        from kiln.train.pretrain import PretrainStage

        return PretrainStage(job, info)
    from kiln.posttrain.sft import SftStage

    return SftStage(job, info)


def train(job: JobConfig, info: DistInfo, reporter: Reporter, callbacks: Iterable = ()) -> dict[str, Any]:
    """Run the job to max_steps, resuming from the newest good checkpoint in out_dir; return the summary."""
    return Trainer(job, make_stage(job, info), info, reporter, callbacks).fit()


def main(argv: list[str] | None = None, reporter: Reporter | None = None, callbacks: Iterable = ()) -> dict[str, Any]:
    return run_job(JobConfig, make_stage, __doc__, argv, reporter, callbacks)


if __name__ == "__main__":
    from kiln.train.preempt import exit_code

    sys.exit(exit_code(main(sys.argv[1:])))
