"""A full disk while training (ENOSPC): found in an error however a save wrapped it, and described by the path that
could not be written and the space left on its filesystem.

Writers name their path with ``with naming(path): ...``; resources.pipes_worker turns ``no_space(error)`` into
``record(...)`` and hands it to the launcher, which stops the job at once: another attempt would find the same disk.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Any, Iterator


def _enospc(error: BaseException | None) -> list[OSError]:
    """Every ENOSPC OSError in ``error``, its causes and contexts, and the per-rank failures of
    torch.distributed.checkpoint's CheckpointException (``failures``: {rank: (error, traceback)}), outermost first."""
    found: list[OSError] = []
    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            found.append(e)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())
        todo.extend([e.__context__, e.__cause__])
    return found


def no_space(error: BaseException | None) -> OSError | None:
    """The first-raised ENOSPC OSError in ``error`` (the deepest: a close that fails again after a failed write
    raises a second one over it), or None when the error is not a full disk."""
    found = _enospc(error)
    return found[-1] if found else None


@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """Give the ENOSPC errors raised inside the ``path`` being written when they name none (a failed ``write()``
    has no file name; only ``open()`` sets one)."""
    try:
        yield
    except BaseException as e:
        for full in _enospc(e):
            if not full.filename:
                full.filename = str(path)
        raise


def free_space(path: str | os.PathLike) -> tuple[int, int] | None:
    """(free, total) bytes of the filesystem holding ``path`` (its nearest existing folder), or None if unreadable.
    statvfs reads the filesystem's counters: nothing is written."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        usage = shutil.disk_usage(p)
    except OSError:
        return None
    return usage.free, usage.total


def record(error: OSError, fallback_path: str | os.PathLike) -> dict[str, Any]:
    """What the launcher needs to say about a full disk: the path (``fallback_path``, the run folder, when the
    error names none), the space free there, the error itself."""
    path = str(error.filename or fallback_path)
    space = free_space(path)
    return {"reason": "no_space", "path": path, "free_bytes": space[0] if space else None,
            "total_bytes": space[1] if space else None, "error": f"{type(error).__name__}: {error}"[:1000]}


def human_bytes(n: int | None) -> str:
    """``1.5 GiB``, ``0 B``; "unknown" for None."""
    if n is None:
        return "unknown"
    size, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024 or unit == "PiB":
            break
        size /= 1024
    return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"


def describe(rec: dict[str, Any]) -> str:
    """One sentence for a ``record``: which path could not be written and the space left on its filesystem."""
    free, total = rec.get("free_bytes"), rec.get("total_bytes")
    space = (f"{human_bytes(free)} free of {human_bytes(total)} on that filesystem" if free is not None
             else "free space on that filesystem unreadable")
    return f"No space left on device (ENOSPC) writing {rec.get('path')} ({space})"
