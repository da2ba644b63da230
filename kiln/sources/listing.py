"""The input files of a source: include globs minus excludes, over a local folder or an fsspec URL (s3://, file://);
symlinks are followed (out of a package's folder only for local sources), and a link that cannot be read is reported.
A local file notes in ``InputFile.change`` whether it changed since it was listed, as it is read.

Use from Python: ``for file in list_files(spec, fetch(spec, cache_dir), refused=[]): data = file.open().read()``.
"""

from __future__ import annotations

import fnmatch
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

from kiln.sources.manifest import DEFAULT_INCLUDE, SourceError, SourceSpec, include_patterns, is_url
from kiln.sources.packages import RECORD


@dataclass
class InputFile:
    """One file of a source: its path relative to the source root, a URL for provenance, and how to open it.

    ``rel`` and ``uri`` are valid UTF-8 (see ``printable``); ``open`` opens the file by its real name."""

    rel: str
    uri: str
    size: int
    open: Callable[[], Any]  # returns a binary file object (local file or fsspec stream)
    change: str = ""  # how a local file changed since it was listed, noted as it is read; "" if it did not

    def __post_init__(self) -> None:
        self.rel, self.uri = printable(self.rel), printable(self.uri)


def printable(name: str) -> str:
    r"""A file name as valid UTF-8, for ids, URLs and reports: bytes of the real name that are not UTF-8 (held by
    Python as lone surrogates) are written as \xNN; the name b'caf\xe9.txt' is shown as caf\xe9.txt."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


class Chunk(NamedTuple):
    """One document's worth of a file, as a reader yields it."""

    suffix: str  # appended to the file's id: "" (whole file), "#3" (line, row or chunk), "@334" (WARC record offset)
    text: str
    url: str | None
    ctype: str  # content type: text/html or text/plain
    offset: int | None  # byte offset in the file where it starts, when known


Refused = list[tuple[str, str, str]]  # (relative path, skip reason, detail) of files matched but not read


def list_files(spec: SourceSpec, root: Path | str, refused: Refused | None = None) -> list[InputFile]:
    """Sorted files matching the include globs minus the excludes, local or through fsspec.

    A file reached twice (e.g. through a symlink) is read once; links that cannot be read (dangling, a loop, out of a
    package's folder) are left out. Both are appended to ``refused``, if given, as (path, reason, detail).
    """
    def note(item: tuple[str, str, str]) -> None:
        if refused is not None:
            refused.append((printable(item[0]), item[1], printable(item[2])))
    if isinstance(root, str) and is_url(root):
        return _url_files(spec, root, note)
    root = Path(root)
    real_root = root.resolve()
    found: dict[str, Path] = {}
    seen: set[str] = set()
    for pattern in include_patterns(spec):
        for p in root.glob(pattern):
            rel = p.relative_to(root).as_posix()
            if rel in seen or rel == RECORD or any(fnmatch.fnmatchcase(rel, x) for x in spec.exclude):
                continue
            seen.add(rel)
            target, problem = _target(p, real_root, outside_ok=spec.kind == "local")
            if problem:
                note((rel, "bad_link", problem))
            elif target is not None:
                found[rel] = target
    files: dict[Path, InputFile] = {}
    for rel in sorted(found):
        target = found[rel]
        if target in files:
            note((rel, "duplicate", f"same file as {files[target].rel}, read once"))
            continue  # the URL names a local file as the source lists it (a link's name, not the blob it points to)
        uri = (real_root / rel).as_uri() if spec.kind == "local" else \
            f"pkg://{'pypi' if spec.kind == 'pip' else 'deb'}/{spec.package}@{spec.version}/{rel}"
        files[target] = _local_file(rel, uri, target)
    return list(files.values())


def _local_file(rel: str, uri: str, path: Path | str) -> InputFile:
    """A local file as listed now; reading it notes in ``change`` whether it changed since."""
    listed = os.stat(path)
    file = InputFile(rel, uri, listed.st_size, lambda: io.BufferedReader(_WatchedFile(file, path, listed)))
    return file


class _WatchedFile(io.FileIO):
    """A local file opened for reading that notes in ``file.change`` how it differs from the file ``listed``: a read
    that finds its end before the listed size, or, when closed, another size or mtime."""

    def __init__(self, file: InputFile, path: Path | str, listed: os.stat_result) -> None:
        super().__init__(path, "rb")
        self.file, self.listed = file, listed

    def readinto(self, buffer: Any) -> int | None:
        n = super().readinto(buffer)
        if n == 0 and len(buffer):  # the end of the file
            self._ended()
        return n

    def readall(self) -> bytes:  # BufferedReader.read() with no size reads through this, not readinto
        data = super().readall()
        self._ended()
        return data

    def _ended(self) -> None:
        if self.tell() < self.listed.st_size and not self.file.change:
            self.file.change = f"reading ended at byte {self.tell():,} of {self.listed.st_size:,}"

    def close(self) -> None:
        if not self.closed:
            now = os.fstat(self.fileno())
            if now.st_size != self.listed.st_size:  # says more than where a read found the end
                self.file.change = f"size {self.listed.st_size:,} -> {now.st_size:,} bytes"
            elif now.st_mtime_ns != self.listed.st_mtime_ns and not self.file.change:
                self.file.change = "modified: its mtime changed, its size did not"
        super().close()


def _target(p: Path, real_root: Path, outside_ok: bool) -> tuple[Path | None, str]:
    """(the file ``p`` leads to, or None if it is no file; why it cannot be read, or "")."""
    link = p.is_symlink()
    try:
        target = p.resolve(strict=True)
    except FileNotFoundError:
        return None, f"dangling symlink to {os.readlink(p)!r}" if link else ""
    except (RuntimeError, OSError) as e:  # RuntimeError: a symlink loop (Python 3.11; later versions raise OSError)
        return None, f"symlink loop ({e})" if link else f"cannot resolve ({e})"
    if not target.is_file():
        return None, ""
    if not outside_ok and not target.is_relative_to(real_root):
        return None, f"link leads out of the package to {target}; not read"
    return target, ""


def _url_files(spec: SourceSpec, url: str, note: Callable[[tuple[str, str, str]], None]) -> list[InputFile]:
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url, **spec.storage_options)
    except (ImportError, ValueError) as e:
        raise SourceError(f"source '{spec.name}': cannot open {url!r}: {e}. For s3:// install s3fs.") from None
    protocol = url.split("://", 1)[0]
    if any(c in path for c in "*?["):
        base = path[: min(path.index(c) for c in "*?[" if c in path)].rsplit("/", 1)[0]
        paths = fs.glob(path)
    elif fs.isfile(path):
        base, paths = path.rsplit("/", 1)[0], [path]
    else:
        base = path.rstrip("/")
        paths = [p for pattern in (spec.include or DEFAULT_INCLUDE[spec.format]) for p in fs.glob(f"{base}/{pattern}")]
    out: dict[str, InputFile] = {}
    for p in sorted(set(paths)):
        rel = p[len(base):].lstrip("/") if p.startswith(base) else p
        if any(fnmatch.fnmatchcase(rel, x) for x in spec.exclude):
            continue
        try:
            info = fs.info(p)
        except OSError as e:  # e.g. a dangling symlink or a loop under file://, or an object deleted since the listing
            link = protocol in ("file", "local") and os.path.islink(p)
            note((rel, "bad_link" if link else "corrupt", f"{'unreadable link' if link else 'cannot stat'}: {e}"))
            continue
        if info.get("type") != "file":
            continue
        full = fs.unstrip_protocol(p) if hasattr(fs, "unstrip_protocol") else f"{protocol}://{p}"
        out[rel] = _local_file(rel, full, p) if protocol in ("file", "local") else \
            InputFile(rel, full, int(info.get("size") or 0), lambda p=p: fs.open(p, "rb"))
    return [out[k] for k in sorted(out)]
