"""Atomic, checksummed file writes, content-addressed output folders, staging folders and file witnesses.

Every writer in Kiln goes through these helpers so a crash never leaves a half-written file; a staging folder left
by a killed process is removed when the next one stages beside it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

CHUNK = 1 << 20
DIGEST = "xxh3_128"  # hashes at several GB/s, faster than disks read; sha256 in Python manages about 0.4 GB/s


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def file_digest(path: str | os.PathLike, algo: str = DIGEST) -> str:
    """Hex digest of a file's bytes with ``algo`` ("xxh3_128", or "sha256").

    xxh3 reads through a memory map, so hashing runs at the disk's read speed (it hashes at several GB/s).
    """
    if algo == "sha256":
        return sha256_file(path)
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return h.hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            try:
                for i in range(0, len(view), 64 << 20):
                    h.update(view[i:i + (64 << 20)])
            finally:
                view.release()
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stable_hash(obj: Any) -> str:
    """Hex sha256 of an object's canonical JSON (sorted keys); used for config and manifest hashes."""
    return sha256_bytes(json.dumps(obj, sort_keys=True, default=str, separators=(",", ":")).encode())


def jsonl_objects(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) for every non-blank line of a JSONL file; a line that is not a JSON object raises
    ValueError naming the file and the line."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e}); repair or delete that line") from e
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: a record must be a JSON object, got {type(row).__name__}; repair or "
                                 "delete that line")
            yield n, row


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
    """A scratch folder under ``parent`` that is deleted unless it was committed (moved away).

    Its name, ``.<name>.<host>-<pid>-<start>.<random>``, says which process owns it: staging folders beside it that
    processes killed part way left behind are removed first (remove_stale_staging)."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(parent, name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.{_owner_token()}.", dir=parent))
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# a staging folder: ``.<name>.<host id>-<pid>-<process start>.<mkdtemp's 8 characters>``; before owners were named,
# ``.<name>.<8 characters>``
_OWNED = re.compile(r"^\.(?P<name>.+)\.(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-(?P<start>\d+)\.[a-z0-9_]{8}$")
_UNOWNED = re.compile(r"^\.(?P<name>.+)\.[a-z0-9_]{8}$")


def remove_stale_staging(parent: str | os.PathLike, name: str | None = None) -> list[Path]:
    """Remove the staging folders (staging_dir's, named ``name`` or any name) directly under ``parent`` whose owner
    is gone: a process of this host that has ended, or, for folders from before owners were named, any folder older
    than this process. Nothing else is touched, and a folder of another host or of a live process is kept."""
    parent = Path(parent)
    try:
        entries = list(parent.iterdir())
    except OSError:
        return []
    removed = []
    for p in entries:
        if p.name.startswith(".") and p.is_dir() and not p.is_symlink() and _is_stale(p, name):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _is_stale(folder: Path, name: str | None) -> bool:
    owned = _OWNED.match(folder.name)
    if owned:
        if name is not None and owned["name"] != name:
            return False
        return owned["host"] == _host_id() and not process_alive(int(owned["pid"]), int(owned["start"]))
    legacy = _UNOWNED.match(folder.name)
    if not legacy or legacy["name"] != (name or "stage"):
        return False
    began = process_start_time()
    return began is not None and folder.stat().st_mtime < began


def _host_id() -> str:
    return sha256_bytes(socket.gethostname().encode())[:8]


def _owner_token() -> str:
    return f"{_host_id()}-{os.getpid()}-{_start_ticks(os.getpid()) or 0}"


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None (no such process, or no /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux); None where /proc does not say."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def process_alive(pid: int, start: int = 0) -> bool:
    """Whether process ``pid`` that started at ``start`` (ticks since boot; 0: unknown) still runs."""
    if Path("/proc/self/stat").exists():
        fields = _proc_stat(pid)
        if not fields or fields[0] in ("Z", "X"):  # no such process, or one killed and not yet reaped
            return False
        return not start or (len(fields) > 19 and int(fields[19]) == start)  # not another that got the same pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def process_start_time() -> float | None:
    """When this process started (Unix time, Linux), or None where /proc does not say."""
    ticks = _start_ticks(os.getpid())
    try:
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)  # to the tick, unlike /proc/stat's btime
        return None if ticks is None else min(time.time(), boot + ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, AttributeError):
        return None


def commit_dir(staged: Path, final: Path) -> Path:
    """Move a fully written staging folder to ``final`` atomically.

    If ``final`` already exists (same content address), the staged copy is discarded and the existing folder kept,
    so a rerun never overwrites what an older model was made from; only files missing from it (a damaged file set
    aside, set_aside) are moved in from the staged copy.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        for f in sorted(p for p in staged.rglob("*") if p.is_file()):
            target = final / f.relative_to(staged)
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(f, target)
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


# ---------------------------------------------------------------------------------------------- witnesses
# A witness records a file's or folder's files as (bytes, modification time, digest) when an output is recorded, so
# that later the output can be checked before it is reused: a file whose size and time are unchanged costs a stat;
# one whose time changed is hashed and compared (the shard cache in kiln.tokens.store does the same).


def witness(path: str | os.PathLike, digests: dict[str, str] | None = None, algo: str = DIGEST,
            names: list[str] | None = None) -> dict[str, Any]:
    """{"algo", "files": {relative path: [bytes, mtime_ns, digest]}} of a file (relative path ".") or of the files
    ``names`` under a folder (default: every non-hidden one). ``digests`` ({relative path: digest} computed with
    ``algo``, e.g. a checkpoint's checksums) are taken as given; every other file is hashed."""
    path = Path(path)
    if path.is_file():
        names = ["."]
    elif names is None:
        names = [p.relative_to(path).as_posix() for p in sorted(path.rglob("*"))
                 if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)]
    out = {}
    for rel in names:
        f = path if rel == "." else path / rel
        st = f.stat()
        known = (digests or {}).get(rel)
        out[rel] = [st.st_size, st.st_mtime_ns, known if known is not None else file_digest(f, algo)]
    return {"algo": algo, "files": out}


def check_witness(path: str | os.PathLike, recorded: dict[str, Any], full: bool = False) -> tuple[Path, str] | None:
    """None when every file ``recorded`` (a ``witness``) is still there with the same bytes, else (the first file
    that is not, what is wrong with it). Files whose size and modification time are unchanged are not read, unless
    ``full``: then every file is hashed (a scrub: a byte flipped with both kept, by bit rot or a stray write)."""
    path = Path(path)
    for rel, (size, mtime_ns, digest) in recorded["files"].items():
        f = path if rel == "." else path / rel
        try:
            st = f.stat()
        except OSError:
            return f, f"{f} is missing"
        if (st.st_size, st.st_mtime_ns) == (size, mtime_ns) and not full:
            continue
        if st.st_size != size:
            return f, f"{f} has {st.st_size:,} bytes where {size:,} were recorded: it is truncated or was replaced"
        actual = file_digest(f, recorded["algo"])
        if actual != digest:
            return f, (f"{f}: checksum mismatch (recorded {digest[:16]}…, found {actual[:16]}…): the file is damaged "
                       "or was replaced")
    return None


class DamagedFileError(RuntimeError):
    """A stored file failed its own checksum or fingerprint when read; ``path`` names it. What reads it says so, and
    the asset layer sets the file aside (assets._common.failing_on_damage) so that the next run recomputes the output
    that holds it instead of failing on it again."""

    def __init__(self, message: str, path: str | os.PathLike):
        super().__init__(message)
        self.path = Path(path)


def set_aside(path: str | os.PathLike) -> Path:
    """Rename a damaged file to ``.<name>.damaged`` beside it (hidden, so no manifest or witness counts it), which
    leaves its place free for commit_dir to fill again; returns the new path."""
    path = Path(path)
    aside = path.with_name(f".{path.name}.damaged")
    os.replace(path, aside)
    return aside
