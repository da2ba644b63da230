"""Preemption: a stop signal (SIGTERM from Slurm, Kubernetes or a spot reclaim; SIGUSR1 from sbatch --signal) asks a
training run to finish its step, save a checkpoint synchronously and exit with PREEMPTED_EXIT.

The handler only sets a flag; kiln.train.trainer.Trainer reads it once per step (on several ranks the flag rides on
the step's loss all-reduce, so every rank stops after the same step). ``python -m kiln.train`` exits with
PREEMPTED_EXIT after such a stop; the launcher reads ``outcome: preempted`` from result.json.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

PREEMPTED_EXIT = 75  # EX_TEMPFAIL (sysexits.h): stopped on request with a checkpoint saved; launch again to resume
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# torchrun forwards these to its workers as their death signal (torch.distributed.elastic reads the variable)
TORCHELASTIC_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


class PreemptionWatch:
    """Catches the stop signals while installed; ``requested`` says whether one came, ``signal_name`` which."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS):
        self.signals = signals
        self.signum: int | None = None
        self.received_at: float | None = None  # time.monotonic() of the first stop signal
        self._previous: dict[int, Any] = {}

    def install(self) -> bool:
        """Install the handlers (only the main thread may); False when they could not be."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return True

    def restore(self) -> None:
        for s, old in self._previous.items():
            signal.signal(s, old)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum, self.received_at = signum, time.monotonic()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def seconds_since(self) -> float:
        return time.monotonic() - self.received_at if self.received_at is not None else 0.0


def exit_code(summary: dict[str, Any] | None) -> int:
    """The process exit code for a job's summary: PREEMPTED_EXIT after a preemption, else 0."""
    return PREEMPTED_EXIT if (summary or {}).get("outcome") == "preempted" else 0
