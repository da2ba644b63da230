"""The durable copy of Kiln's outputs on any fsspec location (s3:// through s3fs, a mounted folder, ...) and the verified local shard cache read by training.

Run: ``python -m kiln.tokens.store publish LOCAL_DIR URL`` / ``python -m kiln.tokens.store fetch URL CACHE_DIR`` (``--option endpoint_url=http://127.0.0.1:9000`` for an S3-compatible server).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from kiln.tokens.shards import MANIFEST, SPLITS, ShardError, load_manifest, mark_verified, parse_manifest, verify_shards
from kiln.common.files import atomic_path, atomic_write_bytes, sha256_file

FETCH_BATCH = 8  # shards downloaded concurrently per batch (and discarded together if one is bad)


class StoreError(RuntimeError):
    """A durable location cannot be reached, read or written; the message names the URL."""


def is_url(location: str | os.PathLike) -> bool:
    """True for ``proto://...`` locations (s3://, gs://, file://, memory://), False for plain local paths."""
    return "://" in str(location)


def join(location: str, *parts: str) -> str:
    """``location/part/part`` for a URL or a local path (never resolves or normalises the URL)."""
    out = str(location).rstrip("/")
    for p in parts:
        out += "/" + str(p).strip("/")
    return out


def filesystem(location: str, options: dict[str, Any] | None = None):
    """(fsspec filesystem, path inside it) for a URL or local path; options go to the filesystem (s3fs: endpoint_url, key, ...)."""
    import fsspec  # fsspec is the one client for every protocol; s3fs implements s3:// for it

    try:
        return fsspec.core.url_to_fs(str(location), **(options or {}))
    except (ImportError, ValueError) as e:
        raise StoreError(f"cannot open storage location {location}: {e}") from e


def _files(local_dir: Path) -> list[str]:
    """Relative paths of every non-hidden file under ``local_dir``, sorted."""
    out = []
    for p in sorted(local_dir.rglob("*")):
        rel = p.relative_to(local_dir)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts):
            out.append(rel.as_posix())
    return out


@dataclass
class PublishResult:
    url: str  # where the durable copy is
    files: int  # files uploaded by this call (0 when the copy was already complete)
    bytes: int  # bytes uploaded by this call


def publish_dir(local_dir: str | os.PathLike, url: str, options: dict[str, Any] | None = None,
                last: str = MANIFEST) -> PublishResult:
    """Upload a finished, content-addressed folder to ``url``; ``last`` goes up after everything else.

    The presence of ``last`` (the manifest) at ``url`` marks a complete copy, so a crash mid-upload
    leaves a copy that readers reject and the next publish completes. If ``url`` already holds
    ``last`` with the same bytes nothing is uploaded; with different bytes it is an error (a
    content-addressed folder never changes). Sizes are checked on the remote side after upload.
    """
    local_dir = Path(local_dir)
    names = _files(local_dir)
    if last not in names:
        raise StoreError(f"{local_dir} has no {last}: only finished folders are published")
    fs, root = filesystem(url, options)
    marker = join(root, last)
    local_marker = (local_dir / last).read_bytes()
    try:
        fs.invalidate_cache(root)  # s3fs caches listings: ask the store itself
        if fs.exists(marker):
            if fs.cat_file(marker) == local_marker:
                return PublishResult(url, 0, 0)
            raise StoreError(f"{join(url, last)} already exists with other content; a published folder is never "
                             f"overwritten (is {local_dir} really the same data version?)")
        body = [n for n in names if n != last]
        rpaths = [join(root, n) for n in body]
        for parent in sorted({r.rsplit("/", 1)[0] for r in rpaths} | {root}):
            fs.makedirs(parent, exist_ok=True)
        if body:
            fs.put([str(local_dir / n) for n in body], rpaths)  # concurrent on object stores
        fs.invalidate_cache(root)
        remote = {k.rstrip("/"): v for k, v in fs.find(root, detail=True).items()}
        for n, r in zip(body, rpaths):
            got = remote.get(fs._strip_protocol(r), {}).get("size")
            want = (local_dir / n).stat().st_size
            if got != want:
                raise StoreError(f"upload of {local_dir / n} to {join(url, n)} left {got} bytes, expected {want}")
        fs.pipe_file(marker, local_marker)
    except StoreError:
        raise
    except Exception as e:  # s3fs/botocore/OS errors: say which location failed
        raise StoreError(f"cannot publish {local_dir} to {url}: {type(e).__name__}: {e}") from e
    return PublishResult(url, len(names), sum((local_dir / n).stat().st_size for n in names))


@dataclass
class FetchResult:
    dir: Path  # local folder holding the verified shards and the manifest
    manifest: dict[str, Any]
    hits: list[str] = field(default_factory=list)  # shards already in the cache and verified
    fetched: list[str] = field(default_factory=list)  # shards downloaded (and verified) by this call
    fetched_bytes: int = 0


def fetch_shards(url: str, cache_dir: str | os.PathLike, options: dict[str, Any] | None = None,
                 splits: Sequence[str] = SPLITS) -> FetchResult:
    """Make ``cache_dir`` a verified local copy of the shards of ``splits`` published at ``url``.

    The manifest is read from ``url``; each wanted shard already in the cache and matching its
    manifest entry (sha256, remembered per unchanged file) is a hit, every other one is downloaded
    to a temporary file, checked (header, size, sha256) and only then renamed into place. So the
    cache never serves a shard the manifest does not vouch for, and a second call on a warm cache
    downloads nothing. A folder (not URL) equal to ``cache_dir`` is verified in place.
    """
    cache_dir = Path(cache_dir)
    if not is_url(url) and Path(url).resolve() == cache_dir.resolve():
        manifest = verify_shards(cache_dir, _wanted(cache_dir, None, splits))
        return FetchResult(cache_dir, manifest, hits=_wanted(cache_dir, manifest, splits))
    fs, root = filesystem(url, options)
    try:
        data = fs.cat_file(join(root, MANIFEST))
    except FileNotFoundError:
        raise ShardError(f"no shard manifest at {join(url, MANIFEST)}: the durable copy is missing or was never "
                         "completed; rematerialize token_shards to publish it") from None
    except Exception as e:
        raise StoreError(f"cannot read {join(url, MANIFEST)}: {type(e).__name__}: {e}") from e
    manifest = parse_manifest(data, join(url, MANIFEST))
    cache_dir.mkdir(parents=True, exist_ok=True)
    local_manifest = cache_dir / MANIFEST
    if local_manifest.exists() and local_manifest.read_bytes() != data:
        raise ShardError(f"cache folder {cache_dir} holds another manifest than {join(url, MANIFEST)}; "
                         "use one cache folder per data version")
    result = FetchResult(cache_dir, manifest)
    todo = []
    for name in _wanted(cache_dir, manifest, splits):
        try:
            verify_shards(cache_dir, [name], manifest)
            result.hits.append(name)
        except ShardError:
            todo.append(name)
    entries = {sh["file"]: sh for sh in manifest["shards"]}
    for i in range(0, len(todo), FETCH_BATCH):
        batch = todo[i:i + FETCH_BATCH]
        with contextlib.ExitStack() as stack:  # every temp file is renamed into place, or all removed
            tmps = [stack.enter_context(atomic_path(cache_dir / n)) for n in batch]
            _download(fs, url, root, batch, tmps)
            for name, tmp in zip(batch, tmps):
                got = sha256_file(tmp)
                if got != entries[name]["sha256"]:
                    raise ShardError(f"shard {join(url, name)}: checksum mismatch, sha256 {got} but "
                                     f"{join(url, MANIFEST)} says {entries[name]['sha256']}; the durable copy is corrupt")
                result.fetched_bytes += tmp.stat().st_size
        mark_verified(cache_dir, {n: entries[n]["sha256"] for n in batch})
        verify_shards(cache_dir, batch, manifest)  # header, size and token count (the hashes were just checked)
        result.fetched += batch
    if not local_manifest.exists():
        atomic_write_bytes(local_manifest, data)  # last: a cache folder with a manifest is complete for its splits
    return result


def fetch_dir(url: str, local_dir: str | os.PathLike, options: dict[str, Any] | None = None,
              last: str = MANIFEST) -> Path:
    """A local copy of the folder published at ``url``, downloaded unless ``local_dir`` already has ``last``.

    For small outputs (a tokenizer, a report) that check themselves when loaded; shard folders go
    through ``fetch_shards``, which verifies every file against the manifest.
    """
    local_dir = Path(local_dir)
    if (local_dir / last).exists():
        return local_dir
    fs, root = filesystem(url, options)
    try:
        fs.invalidate_cache(root)
        if not fs.exists(join(root, last)):
            raise StoreError(f"no complete copy at {url}: {join(url, last)} is missing; rematerialize the asset "
                             "that publishes it")
        prefix = fs._strip_protocol(root).rstrip("/") + "/"
        names = sorted(p[len(prefix):] for p in fs.find(root) if p.startswith(prefix))
        for name in [n for n in names if n != last] + [last]:  # ``last`` marks the local copy complete
            with atomic_path(local_dir / name) as tmp:
                fs.get_file(join(root, name), str(tmp))
    except StoreError:
        raise
    except Exception as e:
        raise StoreError(f"cannot fetch {url} into {local_dir}: {type(e).__name__}: {e}") from e
    return local_dir


def _wanted(cache_dir: Path, manifest: dict[str, Any] | None, splits: Iterable[str]) -> list[str]:
    if manifest is None:
        manifest = load_manifest(cache_dir)
    return [sh["file"] for sh in manifest["shards"] if sh["split"] in set(splits)]


def _download(fs, url: str, root: str, names: list[str], tmps: list[Path]) -> None:
    try:
        fs.get([join(root, n) for n in names], [str(t) for t in tmps])  # concurrent on object stores
    except FileNotFoundError:
        missing = [n for n in names if not fs.exists(join(root, n))]
        raise ShardError(f"shard {join(url, missing[0] if missing else names[0])} named in {join(url, MANIFEST)} "
                         "is missing from the durable copy") from None
    except Exception as e:
        raise StoreError(f"cannot download shards from {url}: {type(e).__name__}: {e}") from e


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Publish a finished shard folder, or fetch one into a verified local cache.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("publish", help="upload LOCAL_DIR to URL, manifest last")
    p.add_argument("local_dir")
    p.add_argument("url")
    f = sub.add_parser("fetch", help="download and verify the shards at URL into CACHE_DIR")
    f.add_argument("url")
    f.add_argument("cache_dir")
    f.add_argument("--split", action="append", choices=SPLITS, help="only these splits (default: all)")
    for q in (p, f):
        q.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="fsspec storage option")
    args = ap.parse_args(argv)
    options = dict(o.split("=", 1) for o in args.option)
    if args.cmd == "publish":
        r = publish_dir(args.local_dir, args.url, options)
        print(f"{r.url}: uploaded {r.files} files, {r.bytes / 1e6:.1f} MB")
    else:
        r = fetch_shards(args.url, args.cache_dir, options, args.split or SPLITS)
        print(f"{r.dir}: {len(r.hits)} cached, {len(r.fetched)} fetched ({r.fetched_bytes / 1e6:.1f} MB), all verified")


if __name__ == "__main__":
    main()
