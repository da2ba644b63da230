"""The run journal: the one append-only record of a training run, ``logbook.jsonl`` in its run folder.

Rank 0 appends one JSON line per record, each stamped with the ``session`` (the training process) that wrote it.
Two views write and read it: kiln.train.goodput (``session``, ``ready`` and ``beat`` records: where the time of each
process went) and kiln.train.logbook (``start``, ``spike`` and ``end`` records: the attempts at the run). A killed
process leaves its attempt without an ``end``; its last ``beat`` says how far it got.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from kiln.train.diskfull import naming

JOURNAL = "logbook.jsonl"


class Journal:
    """Rank 0's writer of one run folder's journal (a no-op on other ranks), for one training process."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.path, self.enabled = Path(run_dir) / JOURNAL, enabled
        self.session = f"{os.getpid()}-{time.time():.6f}"

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # one short line per write: appends stay whole; a full disk names this file (kiln.train.diskfull)
        with naming(self.path), open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({**record, "session": self.session}, default=str) + "\n")

    def read(self) -> list[dict[str, Any]]:
        return read(self.path)


def read(path: Path) -> list[dict[str, Any]]:
    """Every whole record of a journal (a run folder or its file), oldest first; a line cut short by a kill is
    skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / JOURNAL
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
