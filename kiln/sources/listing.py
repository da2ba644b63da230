"""The input files of a source: include globs minus excludes, over a local folder or an fsspec URL (s3://, file://).

Use from Python: ``for file in list_files(spec, fetch(spec, cache_dir)): data = file.open().read()``.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kiln.sources.manifest import DEFAULT_INCLUDE, SourceError, SourceSpec, include_patterns, is_url
from kiln.sources.packages import RECORD


@dataclass
class InputFile:
    """One file of a source: its path relative to the source root, a URL for provenance, and how to open it."""

    rel: str
    uri: str
    size: int
    open: Callable[[], Any]  # returns a binary file object (local file or fsspec stream)


def list_files(spec: SourceSpec, root: Path | str) -> list[InputFile]:
    """Sorted files matching the include globs minus the excludes, local or through fsspec."""
    if isinstance(root, str) and is_url(root):
        return _url_files(spec, root)
    root = Path(root)
    real_root = root.resolve()
    found: dict[str, Path] = {}
    for pattern in include_patterns(spec):
        for p in root.glob(pattern):
            rel = p.relative_to(root).as_posix()
            if rel in found or rel == RECORD or not p.is_file():
                continue
            if any(fnmatch.fnmatchcase(rel, x) for x in spec.exclude):
                continue
            if not p.resolve().is_relative_to(real_root):  # a link leading out of the package
                continue
            found[rel] = p
    unique: dict[Path, InputFile] = {}  # a file reached twice (e.g. through a symlink) is read once
    for rel in sorted(found):
        p = found[rel]
        uri = p.resolve().as_uri() if spec.kind == "local" else \
            f"pkg://{'pypi' if spec.kind == 'pip' else 'deb'}/{spec.package}@{spec.version}/{rel}"
        unique.setdefault(p.resolve(), InputFile(rel, uri, p.stat().st_size, lambda p=p: open(p, "rb")))
    return list(unique.values())


def _url_files(spec: SourceSpec, url: str) -> list[InputFile]:
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
        info = fs.info(p)
        if info.get("type") != "file":
            continue
        rel = p[len(base):].lstrip("/") if p.startswith(base) else p
        if any(fnmatch.fnmatchcase(rel, x) for x in spec.exclude):
            continue
        full = fs.unstrip_protocol(p) if hasattr(fs, "unstrip_protocol") else f"{protocol}://{p}"
        out[rel] = InputFile(rel, full, int(info.get("size") or 0), lambda p=p: fs.open(p, "rb"))
    return [out[k] for k in sorted(out)]
