"""Atomic, checksummed file writes and content-addressed output folders.

Every writer in Kiln goes through these helpers so a crash never leaves a half-written file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

CHUNK = 1 << 20


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stable_hash(obj: Any) -> str:
    """Hex sha256 of an object's canonical JSON (sorted keys); used for config and manifest hashes."""
    return sha256_bytes(json.dumps(obj, sort_keys=True, default=str, separators=(",", ":")).encode())


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync it and rename it into place.

    On an exception the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the final file ordinary permissions
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
        _fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


@contextlib.contextmanager
def staging_dir(parent: str | os.PathLike, name: str = "stage") -> Iterator[Path]:
    """A scratch folder under ``parent`` that is deleted unless it was committed (moved away)."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=parent))
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def commit_dir(staged: Path, final: Path) -> Path:
    """Move a fully written staging folder to ``final`` atomically.

    If ``final`` already exists (same content address), the staged copy is discarded and the
    existing folder kept, so a rerun never overwrites what an older model was made from.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        shutil.rmtree(staged, ignore_errors=True)
        return final
    os.replace(staged, final)
    _fsync_dir(final.parent)
    return final


def manifest_of_dir(root: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {bytes, sha256}} for every file under ``root`` (sorted, hidden files skipped)."""
    out: dict[str, dict[str, Any]] = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts):
            out[str(p.relative_to(root))] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    return out
