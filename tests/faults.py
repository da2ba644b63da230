"""Test-only fault injection for training jobs: crash once at a step, SIGKILL rank 0 at steps (once each), pause
inside checkpoint writes, fail checkpoint writes with ENOSPC (a full disk), train one data batch at a multiplied
learning rate, slow every step down, send SIGTERM (a preemption) at a step; and for the clean step on Ray, a document rule that kills its worker process once
(``KillWorkerOnce``).

One process:   python tests/faults.py --faults F.json --config job.json --device cpu
Under torchrun: python -m torch.distributed.run --nproc_per_node=2 -m tests.faults --faults F.json --config job.json
As the Dagster launcher's worker: set TorchrunResource(worker="tests.faults") and KILN_FAULTS=F.json.
F.json holds Faults fields. It wraps resources.pipes_worker: production code only offers kiln.train.trainer.Callback.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# first, before this script's own folder (sys.path[0] when run as a script), whose kiln/ holds the core's tests; an
# editable install may have put ROOT on the path already, behind it
sys.path.insert(0, str(ROOT))

from kiln.common.config import from_dict  # noqa: E402


def seeded_kill_step(test: str, low: int, high: int) -> tuple[int, str]:
    """(a step in [low, high] to kill a run at, how to replay it): drawn from KILN_KILL_SEED when set, else from the
    test's name, so a failure names the step and its seed and the same command kills at the same step again. A
    schedule that varies KILN_KILL_SEED covers the range over runs."""
    import random
    import zlib

    seed = int(os.environ.get("KILN_KILL_SEED") or zlib.crc32(test.encode()))
    step = random.Random(seed).randint(low, high)
    return step, f"kill at step {step} (replay: KILN_KILL_SEED={seed})"
from kiln.filters.base import Filter  # noqa: E402
from kiln.train.trainer import Callback  # noqa: E402


@dataclass
class Faults:
    fail_at_step: int = -1  # raise at this step once (a crash); the marker out_dir/.failed_once makes it once
    kill_at_steps: list = field(default_factory=list)  # rank 0 SIGKILLs itself at these steps, once each (.killed_at_N)
    kill_after_save: bool = False  # before such a kill, wait for the checkpoint save in flight to commit (a kill that
    # must find the last interval's checkpoint, however slow the machine makes the background save)
    save_pause_s: float = 0.0  # pause inside each checkpoint write: a window for kill-during-save tests
    no_space_from_step: int = -1  # the state file of every checkpoint from this step on fails as on a full disk:
    # OSError ENOSPC naming no file, as a failed write() raises it, each time (a restart would meet it again)
    spike_batch: int = -1  # data batch trained at spike_lr_factor x the learning rate (a poisoned batch)
    spike_lr_factor: float = 1.0
    step_sleep_s: float = 0.0  # sleep after every step: a run slow enough for a test to act while it trains
    term_at_step: int = -1  # rank term_rank sends itself SIGTERM at this step, once (.termed_at_N): a preemption
    term_rank: int = 0

    def write(self, path: Path) -> Path:
        Path(path).write_text(json.dumps(asdict(self)))
        return Path(path)


class FaultInjector(Callback):
    """The Faults, through the Trainer's hooks."""

    def __init__(self, faults: Faults):
        self.faults = faults

    def on_step_end(self, trainer, step: int) -> None:
        f, out, main = self.faults, trainer.out, trainer.info.is_main
        if step == f.fail_at_step and not (out / ".failed_once").exists():
            if main:
                (out / ".failed_once").write_text(str(step))
            raise RuntimeError(f"injected failure at step {step} (fail_at_step)")
        if step in f.kill_at_steps and main and not (out / f".killed_at_{step}").exists():
            if f.kill_after_save:
                trainer.ckpt.wait()
            (out / f".killed_at_{step}").write_text(str(step))
            os.kill(os.getpid(), signal.SIGKILL)
        if step == f.term_at_step and trainer.info.rank == f.term_rank and not (out / f".termed_at_{step}").exists():
            (out / f".termed_at_{step}").write_text(str(step))
            os.kill(os.getpid(), signal.SIGTERM)
        if f.step_sleep_s:
            time.sleep(f.step_sleep_s)

    def before_optimizer_step(self, trainer, batch: int) -> None:
        if batch == self.faults.spike_batch:
            for g in trainer.optimizer.param_groups:
                g["lr"] *= self.faults.spike_lr_factor

    def after_optimizer_step(self, trainer, batch: int) -> None:
        if batch == self.faults.spike_batch:
            for g in trainer.optimizer.param_groups:
                g["lr"] /= self.faults.spike_lr_factor

    def on_checkpoint_write(self, path: Path) -> None:
        if self.faults.save_pause_s:
            time.sleep(self.faults.save_pause_s)
        step = int(re.sub(r"\D", "", path.parent.name))  # the staging folder: .step_0000008.partial
        if 0 <= self.faults.no_space_from_step <= step:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def injector(**faults) -> FaultInjector:
    """``injector(fail_at_step=2)``: the callback to pass to an entry point's ``main(argv, reporter, callbacks)``."""
    return FaultInjector(from_dict(Faults, faults, "faults"))


class KillWorkerOnce(Filter):
    """A clean-step document rule that keeps every document, but SIGKILLs its own process at document ``doc_id``
    the first time (``marker`` records that it did), so a Ray worker dies mid-stage once and the retry passes."""

    name = "fault:kill_worker"
    reasons: tuple[str, ...] = ()

    def __init__(self, doc_id: str, marker: str | Path, every_time: bool = False) -> None:
        self.doc_id, self.marker, self.every_time = doc_id, str(marker), every_time
        self.maker = os.getpid()  # the test's own process, which must never be the one killed

    def reason(self, doc) -> None:
        if doc.id == self.doc_id and (self.every_time or not Path(self.marker).exists()):
            if os.getpid() == self.maker:
                raise RuntimeError(f"KillWorkerOnce reached {doc.id} in the process that made it (pid {self.maker}), "
                                   "not in a worker: refusing to kill the test itself")
            Path(self.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return None

    def detail(self, doc) -> str:
        return ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--faults", default=os.environ.get("KILN_FAULTS", ""), help="JSON file of Faults fields")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    faults = json.loads(Path(args.faults).read_text()) if args.faults else {}
    from resources.pipes_worker import main as worker_main

    worker_main(rest, callbacks=[injector(**faults)])


if __name__ == "__main__":
    main()
