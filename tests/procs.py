"""Test helper: the process tree read from /proc, to check that what a test started is gone afterwards."""

from __future__ import annotations

from pathlib import Path


def children_of() -> dict[int, list[int]]:
    """{parent pid: child pids} of every process now (from /proc/<pid>/stat)."""
    out: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(d.name))
    return out
