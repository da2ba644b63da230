"""The arena's records on disk: votes and cached answers, one JSON object a line, appended atomically.

``VoteLog(home / "arena" / arena_id / "votes.jsonl").append(vote)`` writes one line with a single ``write`` on a
file opened for appending, under an exclusive ``flock``, then fsyncs: a crash leaves whole lines, and two servers on
one file never interleave. ``VoteLog.read()`` gives every vote back; a damaged line is an error naming file and line.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from pathlib import Path
from typing import Any

from kiln.common.files import jsonl_objects

VOTES = ("left", "right", "tie", "both_bad")  # what a person can answer; tie and both_bad count as half a win each
VOTE_KEYS = ("round", "time", "prompt", "left", "right", "vote")
SIDE_KEYS = ("name", "weights")  # each side: the name shown after the vote and the digest of the weights


def append_line(path: Path, record: dict[str, Any], lock: threading.Lock | None = None) -> None:
    """Append ``record`` as one JSON line: one write on an O_APPEND descriptor under flock, then fsync."""
    data = (json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with lock or threading.Lock():
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            written = os.write(fd, data)
            if written != len(data):  # a full disk: say so rather than leave half a line unexplained
                raise OSError(f"{path}: wrote {written} of {len(data)} bytes of a record; free disk space and remove "
                              "the last (partial) line")
            os.fsync(fd)
        finally:
            os.close(fd)


def read_lines(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) for every non-blank line of a JSONL file (none when it does not exist)."""
    return list(jsonl_objects(path)) if path.is_file() else []


def check_vote(path: Path, n: int, row: dict[str, Any]) -> dict[str, Any]:
    """``row`` when it is a whole vote; else ValueError naming the file, the line and what is wrong."""
    missing = [k for k in VOTE_KEYS if k not in row]
    if missing:
        raise ValueError(f"{path}:{n}: vote lacks {missing}; repair or delete that line")
    if row["vote"] not in VOTES:
        raise ValueError(f"{path}:{n}: vote {row['vote']!r} is not one of {list(VOTES)}; repair or delete that line")
    for side in ("left", "right"):
        if not isinstance(row[side], dict) or any(k not in row[side] for k in SIDE_KEYS):
            raise ValueError(f"{path}:{n}: {side!r} must hold {list(SIDE_KEYS)}; repair or delete that line")
    return row


class VoteLog:
    """The votes of one arena, in the order they were cast."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()

    def append(self, vote: dict[str, Any]) -> None:
        append_line(self.path, check_vote(self.path, 0, vote), self._lock)

    def read(self) -> list[dict[str, Any]]:
        return [check_vote(self.path, n, row) for n, row in read_lines(self.path)]


def score_of_left(vote: str) -> float:
    """The left model's score in a comparison: 1 when it is better, 0 when the right one is, else 0.5."""
    return {"left": 1.0, "right": 0.0}.get(vote, 0.5)
