"""Goodput: the share of a run's wall time spent on steps that count, across crashes, restarts and rollbacks.

``GoodputClock`` writes each process's time to the run journal (kiln.train.journal); ``summarize(run_dir)`` (or
``python -m kiln.train.goodput RUN_DIR``) splits the wall time into productive steps, redone steps,
saving, validation, the first start-up, restarting (dead time, later start-ups, rollback restores) and the rest.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from kiln.common.files import process_start_time
from kiln.train.journal import Journal, read


class GoodputClock:
    """Where one training process's time goes, written to the run journal (kiln.train.journal): a ``session`` record
    when the process started, ``ready`` once start-up is over, then cumulative ``beat`` records.

    Beats carry seconds spent in steps, blocked on saves, in validation and restoring checkpoints (this
    session), and the lineage step time: the time of the steps that made the current weights, carried in
    checkpoints so a resumed or rolled-back run knows which earlier work still counts.
    """

    def __init__(self, journal: Journal):
        self.journal = journal
        self.totals = {"step_s": 0.0, "save_s": 0.0, "eval_s": 0.0, "restore_s": 0.0}
        self.lineage_s = 0.0
        self.step = 0
        journal.write({"event": "session", "t": process_start_time() or time.time()})

    def ready(self, step: int, lineage_s: float) -> None:
        """Start-up is over (model built, checkpoint restored): the next thing is a training step."""
        self.step, self.lineage_s = step, lineage_s
        self.journal.write({"event": "ready", "t": time.time(), "step": step, "lineage_s": lineage_s})

    def add(self, kind: str, seconds: float) -> None:
        self.totals[kind] += seconds
        if kind == "step_s":
            self.lineage_s += seconds

    def restored(self, step: int, lineage_s: float) -> None:
        """A rollback replaced the weights with those of ``step``: steps after it no longer count."""
        self.step, self.lineage_s = step, lineage_s

    def beat(self, step: int) -> None:
        self.step = step
        self.journal.write({"event": "beat", "t": time.time(), "step": step, "lineage_s": self.lineage_s,
                            **self.totals})


SESSION_EVENTS = ("session", "ready", "beat")


def summarize(run_dir: Path) -> dict[str, Any]:
    """Split the wall time recorded in a run's journal into where it went; ``goodput`` = productive / wall."""
    sessions: dict[str, dict[str, Any]] = {}
    for rec in read(run_dir):
        if rec.get("event") not in SESSION_EVENTS:
            continue  # the logbook's records of attempts
        s = sessions.setdefault(rec["session"], {"start": rec["t"], "ready": None, "last": None})
        if rec["event"] == "session":
            s["start"] = rec["t"]
        elif rec["event"] == "ready":
            s["ready"] = rec["t"]
            s["last"] = rec
        else:
            s["last"] = rec
    ordered = sorted(sessions.values(), key=lambda s: s["start"])
    if not ordered:
        return {}
    totals = {"step_s": 0.0, "save_s": 0.0, "eval_s": 0.0, "restore_s": 0.0}
    startup = restart = 0.0
    prev_end = None
    for i, s in enumerate(ordered):
        last = s["last"] or {"t": s["start"]}
        ready = s["ready"] if s["ready"] is not None else last["t"]
        if i == 0:
            startup = ready - s["start"]
        else:  # the dead time between a crash and the next start, then that start's own start-up
            restart += max(0.0, ready - prev_end)
        prev_end = last["t"]
        for k in totals:
            totals[k] += float(last.get(k, 0.0))
    wall = prev_end - ordered[0]["start"]
    final = ordered[-1]["last"] or {}
    productive = float(final.get("lineage_s", 0.0))
    redone = max(0.0, totals["step_s"] - productive)
    parts = {"productive_s": productive, "redone_steps_s": redone, "saving_s": totals["save_s"],
             "validation_s": totals["eval_s"], "startup_s": startup, "restarting_s": restart + totals["restore_s"]}
    parts["other_s"] = max(0.0, wall - sum(parts.values()))
    return {"goodput": productive / wall if wall > 0 else 0.0, "wall_s": wall, "sessions": len(ordered),
            **{k: round(v, 3) for k, v in parts.items()}}


if __name__ == "__main__":
    import sys

    print(json.dumps(summarize(Path(sys.argv[1])), indent=2))
