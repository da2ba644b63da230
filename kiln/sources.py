"""Step 1 "collect": fetch pinned public packages (pip, apt) or local files into one Parquet file of raw documents.

Run: ``python -m kiln.sources conf/sources/demo.yaml raw.parquet [--cache-dir DIR]``, or call ``collect()``.
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

from kiln.config import ConfigError, from_dict
from kiln.storage import atomic_path, atomic_write_json, commit_dir, sha256_file, stable_hash, staging_dir

KINDS = ("pip", "apt", "local")
FORMATS = ("html", "text", "jsonl")
ARCHIVES = {"pip": ("wheel", "sdist"), "apt": ("deb",), "local": ("",)}
DEFAULT_INCLUDE = {"html": ["**/*.html", "**/*.htm"], "text": ["**/*.txt"], "jsonl": ["**/*.jsonl"]}
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
COUNTERS = ("documents", "bytes", "files", "empty", "decode_errors")
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
    """Parsing: "html" (one raw page per file), "text" (per file or separator chunk), "jsonl" (per line)."""
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
    """jsonl: the record field holding the document text."""
    url_field: str | None = None
    """jsonl: optional record field holding the document's original URL."""
    separator: str | None = None
    """text: regex (multiline) on which a file is split into documents, e.g. "^%$"; default one document per file."""
    encoding: str | None = None
    """Text encoding of the files; default UTF-8, and for html the charset the page declares (else UTF-8)."""
    path: str = ""
    """local: a folder, a file or a glob (relative to the working directory); files are read in place."""
    max_docs: int | None = None
    """Optional cap on the documents taken from this source (the first ones in sorted file order)."""
    on_decode_error: str = "error"
    """"error": a file or record that does not decode stops the run; "skip": it is skipped and counted."""

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
        if self.on_decode_error not in ("error", "skip"):
            bad(f"'on_decode_error' must be 'error' or 'skip', got {self.on_decode_error!r}")
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
        return _local_root(spec)[0]
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

    Cache hits run no subprocess. Local sources are read in place: their folder is returned.
    """
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


def _patterns(spec: SourceSpec) -> list[str]:
    """The include globs in effect (a local file or glob path becomes the pattern)."""
    return _local_root(spec)[1] if spec.kind == "local" else spec.include


def _files(spec: SourceSpec, root: Path) -> list[tuple[Path, str]]:
    """Sorted (path, relative posix path) of the files matching the include globs minus the excludes."""
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
    unique: dict[Path, tuple[Path, str]] = {}  # a file reached twice (e.g. through a symlink) is read once
    for rel in sorted(found):
        unique.setdefault(found[rel].resolve(), (found[rel], rel))
    return list(unique.values())


def _decode(spec: SourceSpec, data: bytes, where: str, counts: dict[str, int]) -> str | None:
    encoding = spec.encoding or "utf-8"
    if spec.encoding is None and spec.format == "html":
        head = data[:4096]
        m = _CHARSET.search(head) or _XML_ENCODING.search(head)
        if m:
            try:
                encoding = codecs.lookup(m.group(1).decode("ascii")).name
            except LookupError:
                pass
    utf8 = codecs.lookup(encoding).name == "utf-8"
    try:
        return data.decode("utf-8-sig" if utf8 else encoding)  # utf-8-sig also drops a byte-order mark
    except UnicodeDecodeError as e:
        if spec.on_decode_error == "skip":
            counts["decode_errors"] += 1
            return None
        raise SourceError(
            f"source '{spec.name}': {where} is not valid {encoding} (byte 0x{data[e.start]:02x} at offset {e.start}). "
            f"Fix: set `encoding:` on the source to the file's real encoding, exclude the file, or set "
            f"`on_decode_error: skip` to skip and count such files."
        ) from None


def _chunks(
    spec: SourceSpec, path: Path, rel: str, counts: dict[str, int]
) -> Iterator[tuple[int | None, str, str | None]]:
    """(chunk number or None, text, url from the record or None) for each document of one file."""
    if spec.format == "jsonl":
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                line = _decode(spec, raw, f"{rel} line {lineno}", counts)
                if line is None:
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SourceError(
                        f"source '{spec.name}': {rel} line {lineno} is not valid JSON ({e.msg} at column {e.colno}). "
                        f"Fix the line, or drop the file with `exclude:`."
                    ) from None
                if not isinstance(record, dict) or spec.text_field not in record:
                    keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
                    raise SourceError(
                        f"source '{spec.name}': {rel} line {lineno} has no field '{spec.text_field}' (found: {keys}); "
                        f"set `text_field:` on the source."
                    )
                text = record[spec.text_field]
                if text is not None and not isinstance(text, str):
                    raise SourceError(
                        f"source '{spec.name}': {rel} line {lineno}: field '{spec.text_field}' holds a "
                        f"{type(text).__name__}, not a string; set `text_field:` to the field with the text."
                    )
                url = record.get(spec.url_field) if spec.url_field else None
                yield lineno, text or "", str(url) if url else None
        return
    text = _decode(spec, path.read_bytes(), rel, counts)
    if text is None:
        return
    if spec.separator is None:
        yield None, text, None
        return
    for n, chunk in enumerate(re.split(spec.separator, text, flags=re.MULTILINE), 1):
        yield n, chunk.strip("\r\n"), None


def iter_documents(
    spec: SourceSpec, root: str | os.PathLike, stats: dict[str, int] | None = None
) -> Iterator[dict[str, Any]]:
    """Yield the source's documents from the fetched folder ``root``, in sorted file order.

    ``stats``, if given, is updated in place with documents, bytes, files, empty and decode_errors.
    """
    root = Path(root)
    counts = stats if stats is not None else {}
    for key in COUNTERS:
        counts.setdefault(key, 0)
    content_type = "text/html" if spec.format == "html" else "text/plain"
    taken = 0
    for path, rel in _files(spec, root):
        counts["files"] += 1
        if spec.kind == "local":
            base_url = path.resolve().as_uri()
        else:
            base_url = f"pkg://{'pypi' if spec.kind == 'pip' else 'deb'}/{spec.package}@{spec.version}/{rel}"
        for n, text, url in _chunks(spec, path, rel, counts):
            if not text.strip():
                counts["empty"] += 1
                continue
            suffix = f"#{n}" if n is not None else ""
            size = len(text.encode("utf-8"))
            counts["documents"] += 1
            counts["bytes"] += size
            yield {
                "id": f"{spec.name}/{rel}{suffix}",
                "source": spec.name,
                "url": url or base_url + suffix,
                "text": text,
                "content_type": content_type,
                "bytes": size,
                "license": spec.license,
            }
            taken += 1
            if spec.max_docs is not None and taken >= spec.max_docs:
                return


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
                counts: dict[str, int] = {}
                for doc in iter_documents(spec, root, counts):
                    buffer.append(doc)
                    total += 1
                    if len(buffer) >= ROW_GROUP_DOCS:
                        writer.write_table(pa.Table.from_pylist(buffer, SCHEMA))
                        buffer.clear()
                    if total % PROGRESS_EVERY == 0:
                        say(f"{total} documents so far ({spec.name}: {counts['documents']})")
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
                    f"{counts['files']} files "
                    f"({counts['empty']} empty, {counts['decode_errors']} undecodable) in {t2 - t0:.1f}s"
                )
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
    parser = argparse.ArgumentParser(prog="python -m kiln.sources", description="Collect raw documents into Parquet.")
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
