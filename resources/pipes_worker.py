"""torchrun entry point that reports to Dagster through Pipes from rank 0 only.

python -m torch.distributed.run --nproc_per_node=2 -m resources.pipes_worker --config job.json
The job's task picks the training module (kiln.train.entry.TASKS); every rank runs it, rank 0 alone reports.
It imports ``dagster_pipes`` (the small protocol package), never ``dagster`` itself.
"""

from __future__ import annotations

import os
import sys
from typing import Iterable

from kiln.train.entry import entry_point


class PipesReporter:
    def __init__(self, pipes):
        self.pipes = pipes

    def log(self, message: str) -> None:
        self.pipes.log.info(message)
        print(message, flush=True)

    def warning(self, message: str) -> None:  # loss spikes, rollbacks, ranks that disagree
        self.pipes.log.warning(message)
        print(message, flush=True)


def main(argv: list[str], callbacks: Iterable = ()) -> None:
    """Run the job named by ``--config``; ``callbacks`` (kiln.train.trainer.Callback) go to its Trainer."""
    run_job = entry_point(argv)
    if int(os.environ.get("RANK", "0")) == 0 and os.environ.get("DAGSTER_PIPES_CONTEXT"):
        from dagster_pipes import open_dagster_pipes

        with open_dagster_pipes() as pipes:
            summary = run_job(argv, PipesReporter(pipes), callbacks)
            pipes.report_custom_message({"final_val_loss": summary.get("final_val_loss"), "steps": summary.get("steps")})
    else:
        run_job(argv, None, callbacks)


if __name__ == "__main__":
    main(sys.argv[1:])
