"""torchrun entry point that reports to Dagster through Pipes from rank 0 only.

python -m torch.distributed.run --nproc_per_node=2 -m resources.pipes_worker --config job.json
The job's task picks the module (kiln.train.loop, kiln.posttrain.dpo or kiln.posttrain.rl; see kiln.posttrain.common.ENTRY_POINTS).
It imports ``dagster_pipes`` (the small protocol package), never ``dagster`` itself.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable


def entry_point(argv: list[str]) -> Callable[..., dict[str, Any]]:
    """kiln.train.loop's main for pretraining and SFT; other tasks through kiln.posttrain.common.ENTRY_POINTS. kiln.train.loop is
    imported directly because kiln.posttrain.common loads MLflow at import, seconds on every worker (re)start."""
    path = argv[argv.index("--config") + 1] if "--config" in argv else None
    task = json.loads(Path(path).read_text()).get("task", "pretrain") if path else "pretrain"
    if task in ("pretrain", "sft"):
        from kiln.train.loop import main

        return main
    from kiln.posttrain.common import entry_point as posttrain_entry_point

    return posttrain_entry_point(argv)


class PipesReporter:
    def __init__(self, pipes):
        self.pipes = pipes

    def log(self, message: str) -> None:
        self.pipes.log.info(message)
        print(message, flush=True)

    def warning(self, message: str) -> None:  # loss spikes, rollbacks, ranks that disagree
        self.pipes.log.warning(message)
        print(message, flush=True)


def main(argv: list[str]) -> None:
    run_job = entry_point(argv)
    if int(os.environ.get("RANK", "0")) == 0 and os.environ.get("DAGSTER_PIPES_CONTEXT"):
        from dagster_pipes import open_dagster_pipes

        with open_dagster_pipes() as pipes:
            summary = run_job(argv, PipesReporter(pipes))
            pipes.report_custom_message({"final_val_loss": summary.get("final_val_loss"), "steps": summary.get("steps")})
    else:
        run_job(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
