"""torchrun entry point that reports to Dagster through Pipes from rank 0 only.

python -m torch.distributed.run --nproc_per_node=2 -m resources.pipes_worker --config job.json
The job's task picks the training module (kiln.train.entry.TASKS); every rank runs it, rank 0 alone reports.
It imports ``dagster_pipes`` (the small protocol package), never ``dagster`` itself. A worker ends itself once its
torchrun or the process that launched the job (KILN_LAUNCHER_PID) is gone, rather than train on as an orphan. A worker
that finds the disk full (ENOSPC) asks the launcher that reads its output (KILN_STOP_TOKEN) to stop the job rather
than let torchrun restart it: a restart would find the same full disk.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable

from kiln.common.files import process_alive
from kiln.train.diskfull import no_space, record
from kiln.train.entry import entry_point
from kiln.train.preempt import exit_code


class PipesReporter:
    def __init__(self, pipes):
        self.pipes = pipes

    def log(self, message: str) -> None:
        self.pipes.log.info(message)
        print(message, flush=True)

    def warning(self, message: str) -> None:  # loss spikes, rollbacks, ranks that disagree
        self.pipes.log.warning(message)
        print(message, flush=True)


LAUNCHER_ENV = "KILN_LAUNCHER_PID"  # the pid of the process that launched the job (set by resources.torchrun)
WATCH_INTERVAL_S = 0.5  # how often a worker checks that torchrun and the launcher still run
# set by resources.torchrun's local launcher, which reads the workers' output: a line "<token> <json>" there asks it
# to stop the whole job now (torchrun and every worker, SIGKILL) and fail the launch without a retry
STOP_ENV = "KILN_STOP_TOKEN"
STOP_WAIT_S = 60.0  # a worker that asked to be stopped waits this long for it, then exits (and torchrun restarts it)


def orphan_reason(parent: int | None, launcher: int | None) -> str | None:
    """Why this worker is an orphan (its torchrun ``parent`` or its ``launcher`` has ended), or None."""
    if parent is not None and os.getppid() != parent:
        return f"its torchrun (pid {parent}) has ended"
    if launcher and not process_alive(launcher):
        return f"the process that launched the job (pid {launcher}) has ended"
    return None


def stop_orphan(reason: str) -> None:
    """SIGKILL this worker and, when it leads its process group (torchrun starts each worker in a session of its
    own), what it started; the newest good checkpoint is where the next launch resumes."""
    try:
        print(f"worker {os.getpid()}: stopping: {reason}", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # the log pipe's reader is gone with the launcher
        pass
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def watch_for_orphaning(interval_s: float = WATCH_INTERVAL_S,
                        stop: Callable[[str], None] = stop_orphan) -> threading.Thread | None:
    """Under torchrun, a daemon thread that calls ``stop`` once torchrun (this process's parent) or the launcher
    named by LAUNCHER_ENV has ended. The launcher's death SIGKILLs torchrun on Linux (resources.torchrun
    die_with_parent); this watch ends the workers, there and anywhere torchrun outlives its launcher."""
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    launcher = int(os.environ.get(LAUNCHER_ENV) or 0) or None
    if not under_torchrun and launcher is None:
        return None
    parent = os.getppid() if under_torchrun else None
    reason = orphan_reason(parent, launcher)
    if reason:  # already gone: stop before loading anything
        stop(reason)

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            found = orphan_reason(parent, launcher)
            if found:
                stop(found)
                return

    thread = threading.Thread(target=watch, name="kiln-orphan-watch", daemon=True)
    thread.start()
    return thread


def ask_launcher_to_stop(request: dict[str, Any]) -> bool:
    """Send ``request`` to the launcher as one line on stdout, a pipe it reads (nothing is written to disk, which may
    be full); False when no launcher reads this worker's output for it (STOP_ENV unset: Slurm, a plain torchrun)."""
    token = os.environ.get(STOP_ENV)
    if not token:
        return False
    # one write(2) under PIPE_BUF is never interleaved with another rank's output; the leading newline ends any
    # partial line before it
    line = f"\n{token} {json.dumps(request)}\n".encode()
    try:
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), line)
    except (OSError, ValueError):
        return False
    return True


def run_folder(argv: list[str]) -> str:
    """The job's run folder (``out_dir`` in the ``--config`` file), named when a full disk's error names no file."""
    config = Path(argv[argv.index("--config") + 1]) if "--config" in argv else Path("job.json")
    try:
        return str(json.loads(config.read_text()).get("out_dir") or config.parent)
    except (OSError, ValueError, AttributeError):
        return str(config.parent)


def stopping_on_a_full_disk(run_job: Callable[..., dict[str, Any]], argv: list[str]) -> Callable[..., dict[str, Any]]:
    """``run_job``, except that a full disk (ENOSPC anywhere in the error) asks the launcher to stop the job and
    waits to be stopped (SIGKILL) instead of exiting, which torchrun would answer with a restart."""

    def run(*args: Any) -> dict[str, Any]:
        try:
            return run_job(*args)
        except BaseException as e:
            full = no_space(e)
            if full is None:
                raise
            request = {**record(full, run_folder(argv)), "rank": int(os.environ.get("RANK", "0"))}
            if not os.environ.get(STOP_ENV):
                raise
            traceback.print_exc()  # into the launcher's log, as an exit would have printed it
            if not ask_launcher_to_stop(request):
                raise
            time.sleep(STOP_WAIT_S)
            print(f"worker {os.getpid()}: the launcher did not stop the job within {STOP_WAIT_S:g}s", file=sys.stderr,
                  flush=True)
            raise

    return run


def main(argv: list[str], callbacks: Iterable = ()) -> None:
    """Run the job named by ``--config``; ``callbacks`` (kiln.train.trainer.Callback) go to its Trainer."""
    watch_for_orphaning()
    run_job = stopping_on_a_full_disk(entry_point(argv), argv)
    if int(os.environ.get("RANK", "0")) == 0 and os.environ.get("DAGSTER_PIPES_CONTEXT"):
        from dagster_pipes import open_dagster_pipes

        with open_dagster_pipes() as pipes:
            summary = run_job(argv, PipesReporter(pipes), callbacks)
            pipes.report_custom_message({"final_val_loss": summary.get("final_val_loss"), "steps": summary.get("steps"),
                                         "outcome": summary.get("outcome")})
    else:
        summary = run_job(argv, None, callbacks)
    if exit_code(summary):  # preempted: a checkpoint of the last step is saved; the launcher reads result.json
        sys.exit(exit_code(summary))


if __name__ == "__main__":
    main(sys.argv[1:])
