"""torchrun entry point that reports to Dagster through Pipes from rank 0 only.

python -m torch.distributed.run --nproc_per_node=2 -m resources.pipes_worker --config job.json
It imports ``dagster_pipes`` (the small protocol package), never ``dagster`` itself.
"""

from __future__ import annotations

import os
import sys

from kiln import train


class PipesReporter:
    def __init__(self, pipes):
        self.pipes = pipes

    def log(self, message: str) -> None:
        self.pipes.log.info(message)
        print(message, flush=True)


def main(argv: list[str]) -> None:
    if int(os.environ.get("RANK", "0")) == 0 and os.environ.get("DAGSTER_PIPES_CONTEXT"):
        from dagster_pipes import open_dagster_pipes

        with open_dagster_pipes() as pipes:
            summary = train.main(argv, PipesReporter(pipes))
            pipes.report_custom_message({"final_val_loss": summary.get("final_val_loss"), "steps": summary.get("steps")})
    else:
        train.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
