"""Token shards in llm.c's layout (1024-byte int32 header, then uint16/uint32 tokens) with a checksummed manifest.

Use from Python: ``write_shards(enc, docs, out_dir, ...)`` then ``verify_shards(out_dir)`` and ``read_shard(path)``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import multiprocessing as mp
import os
from collections import deque
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import tiktoken

from kiln.common.files import DamagedFileError, atomic_path, atomic_write_json, sha256_file
from kiln.tokens.tokenizer import encoding_fingerprint

MAGIC = 20240520
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
VERSIONS = {1: np.dtype("<u2"), 2: np.dtype("<u4")}  # llm.c: version 1 = uint16 tokens, 2 = uint32
MANIFEST = "manifest.json"
VERIFIED = ".verified.json"  # {file: [size, mtime_ns, sha256]} of shards already hashed
SPLITS = ("train", "val")
BATCH_CHARS = 1 << 18  # text handed to one encode task


class ShardError(ValueError):
    """A shard or manifest is missing, truncated, corrupt or inconsistent; the message names the file."""


class DamagedShardError(ShardError, DamagedFileError):
    """A shard whose bytes no longer match its manifest's sha256 (bit rot, a stray write): the asset layer sets it
    aside so that the next run recomputes the token shards (assets._common.failing_on_damage)."""

    def __init__(self, message: str, path: str | os.PathLike):
        DamagedFileError.__init__(self, message, path)


def split_of(doc_id: str, val_permille: int) -> str:
    """'val' iff sha256(doc id) mod 1000 < val_permille: fixed per id, so adding data never moves a document."""
    h = int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "big")
    return "val" if h % 1000 < val_permille else "train"


def shard_dtype(n_vocab: int) -> np.dtype:
    """uint16 when every token id fits (n_vocab <= 65536), else uint32."""
    return VERSIONS[1] if n_vocab <= 1 << 16 else VERSIONS[2]


def shard_header(n_tokens: int, dtype: np.dtype) -> bytes:
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC, 1 if np.dtype(dtype).itemsize == 2 else 2, n_tokens)
    return header.tobytes()


# --- encoding workers -------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(enc: tiktoken.Encoding, dtype: str) -> None:
    _WORKER.update(enc=enc, dtype=np.dtype(dtype))


def _encode_docs(texts: Sequence[str], enc: tiktoken.Encoding, dtype: np.dtype) -> np.ndarray:
    """[EOT, doc0 tokens..., EOT, doc1 tokens..., ...] as one flat array of ``dtype``.

    ``encode_to_numpy(text, disallowed_special=())`` runs the same Rust BPE as ``encode_ordinary``
    (special-token strings in the text are encoded as plain text; tests check the ids are equal)
    but hands back its token buffer without building a Python list, and releases the GIL while
    it encodes, so a thread pool scales across cores.
    """
    eot = np.array([enc.eot_token], dtype=np.uint32)
    parts: list[np.ndarray] = []
    for text in texts:
        parts.append(eot)
        parts.append(enc.encode_to_numpy(text, disallowed_special=()))  # (n,) uint32
    # ids were checked to fit ``dtype`` before encoding started, so the narrowing cast is exact
    return np.concatenate(parts, dtype=dtype, casting="unsafe") if parts else np.zeros(0, dtype=dtype)


def _encode_task(texts: Sequence[str]) -> np.ndarray:
    return _encode_docs(texts, _WORKER["enc"], _WORKER["dtype"])


def _tasks(docs: Iterable[tuple[str, str]], val_permille: int, counts: dict[str, int]) -> Iterator[tuple[str, list[str]]]:
    """Group documents per split into tasks of about BATCH_CHARS characters, in input order per split."""
    pending: dict[str, list[str]] = {s: [] for s in SPLITS}
    size = {s: 0 for s in SPLITS}
    for doc_id, text in docs:
        split = split_of(doc_id, val_permille)
        counts[split] += 1
        pending[split].append(text)
        size[split] += len(text)
        if size[split] >= BATCH_CHARS:
            yield split, pending[split]
            pending[split], size[split] = [], 0
    for split in SPLITS:
        if pending[split]:
            yield split, pending[split]


def _pooled(pool: Executor, fn: Callable[[list[str]], np.ndarray], tasks: Iterable[tuple[str, list[str]]],
            depth: int) -> Iterator[tuple[str, np.ndarray]]:
    """``fn`` over tasks in ``pool``, results in input order, at most ``depth`` in flight (bounded memory)."""
    inflight: deque[tuple[str, Future]] = deque()
    for split, texts in tasks:
        inflight.append((split, pool.submit(fn, texts)))
        if len(inflight) >= depth:
            split, fut = inflight.popleft()
            yield split, fut.result()
    while inflight:
        split, fut = inflight.popleft()
        yield split, fut.result()


# --- writing ----------------------------------------------------------------------------------


def write_shards(
    enc: tiktoken.Encoding,
    docs: Iterable[tuple[str, str]],
    out_dir: Path,
    shard_tokens: int,
    val_permille: int,
    num_workers: int,
    progress: Callable[[int, int], None] | None = None,
    *,
    dtype: str | np.dtype | None = None,
    executor: str = "thread",
) -> dict[str, Any]:
    """Encode ``(doc id, text)`` pairs into train/val shards under ``out_dir`` and return the manifest.

    Each document is ``[EOT] + enc.encode_ordinary(text)``; documents are concatenated in input
    order per split and cut into shards of ``shard_tokens`` tokens (the last one shorter), so a
    document may span two shards. Documents go to 'val' by ``split_of(doc id, val_permille)``.
    ``num_workers > 1`` encodes batches of ~BATCH_CHARS in a pool, in order, with bounded
    read-ahead: ``executor="thread"`` (default; tiktoken's Rust encoder releases the GIL and hands
    back numpy buffers, so the threads use every core; bench/bench_shards.py measures it against raw
    ``encode_ordinary_batch`` with the same threads), or a spawned ``"process"`` pool, which pays
    for starting interpreters and pickling every batch (10x slower on a few MB) and needs an
    importable ``__main__``. ``dtype`` forces the token type (default: ``shard_dtype(enc.n_vocab)``).
    ``progress(documents_done, tokens_done)`` is called after each encoded batch. Every shard and
    ``manifest.json`` are written atomically; ``out_dir`` must hold no shards yet. The manifest
    lists per shard file, split, tokens, bytes, sha256 and documents (documents *starting* in it,
    i.e. its EOT count), plus per-split totals, dtype, vocab size and the encoding fingerprint.
    """
    out_dir = Path(out_dir)
    dt = _checked_dtype(enc, out_dir, shard_tokens, val_permille, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.glob("*.bin")) or (out_dir / MANIFEST).exists():
        raise ShardError(f"{out_dir} already holds shards; write into an empty folder")
    counts = {s: 0 for s in SPLITS}
    packer = _Packer(out_dir, shard_tokens, dt, enc.eot_token)
    done_docs = done_tokens = 0
    with _encoded(enc, dt, _tasks(docs, val_permille, counts), num_workers, executor) as results:
        for split, arr in results:
            done_tokens += len(arr)
            done_docs += int(np.count_nonzero(arr == enc.eot_token))
            packer.add(split, arr)
            if progress is not None:
                progress(done_docs, done_tokens)
    if not sum(counts.values()):
        raise ShardError(f"write_shards: no documents to write into {out_dir} (empty input)")
    packer.finish()
    manifest = _manifest(enc, dt, shard_tokens, val_permille, counts, packer.shards)
    atomic_write_json(out_dir / MANIFEST, manifest)
    return manifest


def _checked_dtype(enc: tiktoken.Encoding, out_dir: Path, shard_tokens: int, val_permille: int,
                   dtype: str | np.dtype | None) -> np.dtype:
    """The shards' token dtype, after checking the arguments and that every token id of ``enc`` fits it."""
    if shard_tokens < 1 or not 0 <= val_permille <= 1000:
        raise ValueError(f"shard_tokens must be >= 1 and val_permille in [0, 1000]; got {shard_tokens}, {val_permille}")
    dt = np.dtype(dtype).newbyteorder("<") if dtype is not None else shard_dtype(enc.n_vocab)
    if dt not in VERSIONS.values():
        raise ValueError(f"shard dtype must be uint16 or uint32, got {dt}")
    if enc.max_token_value > np.iinfo(dt).max:
        raise ShardError(f"{out_dir}: vocabulary of encoding {enc.name!r} ({enc.n_vocab} tokens, largest id "
                         f"{enc.max_token_value}) is larger than {dt.name} shards can hold; use dtype uint32 "
                         "or leave dtype unset to choose it from the vocabulary")
    return dt


@contextlib.contextmanager
def _encoded(enc: tiktoken.Encoding, dt: np.dtype, tasks: Iterable[tuple[str, list[str]]], num_workers: int,
             executor: str) -> Iterator[Iterator[tuple[str, np.ndarray]]]:
    """(split, tokens) per task in input order: encoded inline for one worker, else in a thread or spawned process
    pool that is shut down on leaving the block."""
    if num_workers <= 1:
        yield ((s, _encode_docs(t, enc, dt)) for s, t in tasks)
        return
    pool: Executor
    if executor == "thread":
        pool = ThreadPoolExecutor(num_workers)
        fn: Callable[[list[str]], np.ndarray] = functools.partial(_encode_docs, enc=enc, dtype=dt)
    elif executor == "process":
        pool = ProcessPoolExecutor(num_workers, mp.get_context("spawn"), _init_worker, (enc, dt.str))
        fn = _encode_task
    else:
        raise ValueError(f"executor must be 'process' or 'thread', got {executor!r}")
    try:
        yield _pooled(pool, fn, tasks, 2 * num_workers)
    finally:
        pool.shutdown(cancel_futures=True)


class _Packer:
    """Concatenates each split's encoded batches and cuts them into shards of ``shard_tokens`` tokens, written in
    order as they fill (the last one of a split shorter); ``shards`` collects their manifest entries."""

    def __init__(self, out_dir: Path, shard_tokens: int, dt: np.dtype, eot: int) -> None:
        self.out_dir, self.shard_tokens, self.dt, self.eot = out_dir, shard_tokens, dt, eot
        self.buffers: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
        self.buffered = {s: 0 for s in SPLITS}
        self.n_index = {s: 0 for s in SPLITS}
        self.shards: list[dict[str, Any]] = []

    def add(self, split: str, tokens: np.ndarray) -> None:
        """Append one batch; every shard it completes is written now."""
        self.buffers[split].append(tokens)
        self.buffered[split] += len(tokens)
        self._flush(split, final=False)

    def finish(self) -> None:
        """Write what is left of each split as its last, shorter shard."""
        for split in SPLITS:
            self._flush(split, final=True)

    def _flush(self, split: str, final: bool) -> None:
        if self.buffered[split] < self.shard_tokens and not (final and self.buffered[split]):
            return
        tokens = np.concatenate(self.buffers[split])
        cut = len(tokens) if final else len(tokens) - len(tokens) % self.shard_tokens
        for start in range(0, cut, self.shard_tokens):
            name = f"{split}_{self.n_index[split]:06d}.bin"
            piece = tokens[start:min(start + self.shard_tokens, cut)]
            entry = _write_shard(self.out_dir / name, piece, self.dt, self.eot)
            self.shards.append({"file": name, "split": split, **entry})
            self.n_index[split] += 1
        self.buffers[split] = [tokens[cut:]] if cut < len(tokens) else []
        self.buffered[split] = len(tokens) - cut


def _write_shard(path: Path, tokens: np.ndarray, dt: np.dtype, eot: int) -> dict[str, Any]:
    """Write one shard atomically (llm.c header, then the tokens); its tokens, bytes, sha256 and documents."""
    header, body = shard_header(len(tokens), dt), np.ascontiguousarray(tokens, dtype=dt)
    digest = hashlib.sha256(header)
    digest.update(body)  # hashed and written from the array's memory: no copy of the shard
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(header)
        f.write(body.data)
    return {"tokens": int(len(tokens)), "bytes": len(header) + body.nbytes, "sha256": digest.hexdigest(),
            "documents": int(np.count_nonzero(tokens == eot))}


def _manifest(enc: tiktoken.Encoding, dt: np.dtype, shard_tokens: int, val_permille: int, counts: dict[str, int],
              shards: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest of written shards: format, dtype, encoding, split rule, per-split totals and one entry per shard."""
    totals = {s: {"shards": 0, "tokens": 0, "bytes": 0, "documents": counts[s]} for s in SPLITS}
    for sh in shards:
        t = totals[sh["split"]]
        t["shards"] += 1
        t["tokens"] += sh["tokens"]
        t["bytes"] += sh["bytes"]
    return {
        "format": "llm.c", "magic": MAGIC, "version": 1 if dt.itemsize == 2 else 2, "header_bytes": HEADER_BYTES,
        "dtype": dt.name, "vocab_size": enc.n_vocab, "eot_token": enc.eot_token, "encoding": enc.name,
        "encoding_fingerprint": encoding_fingerprint(enc), "shard_tokens": shard_tokens,
        "val_permille": val_permille, "split_rule": "sha256(doc id)[:8] big-endian mod 1000 < val_permille",
        "documents": dict(counts), "splits": totals, "shards": shards,
    }


# --- reading ----------------------------------------------------------------------------------


def read_shard(path: str | os.PathLike, expected_sha256: str | None = None, vocab_size: int | None = None) -> np.ndarray:
    """Tokens of one shard as a read-only memmap, after checking header, size and (optionally) checksum.

    ``vocab_size`` is checked against the shard's dtype (a uint16 shard cannot hold ids >= 65536).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ShardError(f"shard {path} cannot be read: {e}") from e
    if size < HEADER_BYTES:
        raise ShardError(f"shard {path} is truncated: {size} bytes, shorter than the {HEADER_BYTES}-byte header")
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    magic, version, n_tokens = (int(v) for v in header[:3])
    if magic != MAGIC:
        raise ShardError(f"shard {path} has bad magic {magic} (expected {MAGIC}); not an llm.c token shard")
    if version not in VERSIONS:
        raise ShardError(f"shard {path} has unknown version {version} (expected 1 = uint16 or 2 = uint32)")
    dt = VERSIONS[version]
    expected = HEADER_BYTES + n_tokens * dt.itemsize
    if n_tokens < 0 or size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise ShardError(f"shard {path} is {what}: header says {n_tokens} {dt.name} tokens = {expected} bytes, "
                         f"file has {size}")
    if vocab_size is not None and vocab_size - 1 > np.iinfo(dt).max:
        raise ShardError(f"shard {path}: vocabulary of {vocab_size} tokens is larger than its {dt.name} tokens can hold")
    if expected_sha256 is not None:
        got = sha256_file(path)
        if got != expected_sha256:
            raise DamagedShardError(f"shard {path}: checksum mismatch, sha256 {got} but the manifest says "
                                    f"{expected_sha256}", path)
    if n_tokens == 0:
        return np.zeros(0, dtype=dt)  # memmap cannot map zero bytes
    return np.memmap(path, dtype=dt, mode="r", offset=HEADER_BYTES, shape=(n_tokens,))


def load_manifest(shard_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``manifest.json`` of a shard folder; a missing or unreadable one is a ShardError naming it."""
    path = Path(shard_dir) / MANIFEST
    try:
        return parse_manifest(path.read_bytes(), str(path))
    except OSError as e:
        raise ShardError(f"cannot read shard manifest {path}: {e}") from e


def parse_manifest(data: bytes, where: str) -> dict[str, Any]:
    """A manifest from its bytes; ``where`` (a path or URL) names it in errors."""
    try:
        manifest = json.loads(data)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list):
            raise ValueError("no 'shards' list")
        for entry in manifest["shards"]:
            missing = [k for k in ("file", "split", "tokens", "sha256") if k not in entry]
            if missing:
                raise ValueError(f"shard entry {entry!r} lacks {', '.join(missing)}")
    except ValueError as e:
        raise ShardError(f"cannot read shard manifest {where}: {e}") from e
    return manifest


def shard_table(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per shard of a manifest, for display: file, split, tokens, documents and the sha256's first 16 hex digits."""
    return [{k: sh[k] for k in ("file", "split", "tokens", "documents")} | {"sha256": sh["sha256"][:16]}
            for sh in manifest["shards"]]


def shard_paths(shard_dir: str | os.PathLike, split: str) -> list[Path]:
    """Paths of one split's shards in manifest order."""
    return [Path(shard_dir) / s["file"] for s in load_manifest(shard_dir)["shards"] if s["split"] == split]


def _load_verified(shard_dir: Path) -> dict[str, list]:
    try:
        marks = json.loads((shard_dir / VERIFIED).read_text())
        return marks if isinstance(marks, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_verified(shard_dir: Path, marks: dict[str, list]) -> None:
    """Record hashed shards; a read-only folder just means they are hashed again next time."""
    with contextlib.suppress(OSError):
        atomic_write_json(shard_dir / VERIFIED, marks)


def mark_verified(shard_dir: str | os.PathLike, checked: dict[str, str]) -> None:
    """Remember that the shards ``{file: sha256}`` in ``shard_dir`` were just hashed (by a caller that did so)."""
    shard_dir = Path(shard_dir)
    marks = _load_verified(shard_dir)
    for name, sha in checked.items():
        st = (shard_dir / name).stat()
        marks[name] = [st.st_size, st.st_mtime_ns, sha]
    _save_verified(shard_dir, marks)


def verify_shards(shard_dir: str | os.PathLike, files: Iterable[str] | None = None,
                  manifest: dict[str, Any] | None = None, full: bool = False) -> dict[str, Any]:
    """Check that every shard named in the manifest (or only ``files``) exists and matches its entry.

    Each shard's header, size, token count, dtype and sha256 are checked. A shard hashed before and
    unchanged since (same size and modification time, remembered in the hidden ``.verified.json``
    beside it, which the folder's content hash ignores) is not hashed again, so checking a large
    cache on every loader start costs a ``stat`` per shard. ``manifest`` defaults to the folder's
    ``manifest.json``. ``full``: hash every shard, remembered or not (a byte flipped with size and time kept is
    found only so). Returns the manifest; any mismatch is a ShardError naming the file (DamagedShardError for a
    checksum).
    """
    shard_dir = Path(shard_dir)
    if manifest is None:
        manifest = load_manifest(shard_dir)
    entries = {sh["file"]: sh for sh in manifest["shards"]}
    names = list(entries) if files is None else list(files)
    marks = _load_verified(shard_dir)
    changed = False
    for name in names:
        sh = entries.get(name)
        if sh is None:
            raise ShardError(f"shard {shard_dir / name} is not listed in {shard_dir / MANIFEST}; "
                             "pass shards of one folder with its own manifest")
        path = shard_dir / name
        if not path.exists():
            raise ShardError(f"shard {name} named in {shard_dir / MANIFEST} is missing from {shard_dir}")
        st = path.stat()
        known = not full and marks.get(name) == [st.st_size, st.st_mtime_ns, sh["sha256"]]
        tokens = read_shard(path, None if known else sh["sha256"], manifest.get("vocab_size"))
        if len(tokens) != sh["tokens"] or tokens.dtype.name != manifest.get("dtype", tokens.dtype.name):
            raise ShardError(f"shard {path}: {len(tokens)} {tokens.dtype.name} tokens, "
                             f"manifest says {sh['tokens']} {manifest.get('dtype')}")
        if not known:
            marks[name] = [st.st_size, st.st_mtime_ns, sh["sha256"]]
            changed = True
    if changed:
        _save_verified(shard_dir, marks)
    return manifest


def check_shard_files(paths: Sequence[str | os.PathLike], full: bool = False) -> None:
    """Verify shards against the manifest of the folder they sit in, where there is one (see verify_shards; ``full``
    hashes every one).

    Shards in a folder without ``manifest.json`` (e.g. llm.c's own) get the header and size check
    of ``read_shard`` only.
    """
    by_dir: dict[Path, list[str]] = {}
    for p in paths:
        p = Path(p)
        by_dir.setdefault(p.parent, []).append(p.name)
    for folder, names in by_dir.items():
        if (folder / MANIFEST).exists():
            verify_shards(folder, names, full=full)


def decode_documents(enc: tiktoken.Encoding, shard_paths: Sequence[str | os.PathLike]) -> list[str]:
    """Texts of the documents in the given shards, in order (each starts after an EOT)."""
    arrays = [np.asarray(read_shard(p)) for p in shard_paths]
    if not arrays:
        return []
    tokens = np.concatenate(arrays).astype(np.int64)
    starts = np.flatnonzero(tokens == enc.eot_token)
    if len(tokens) and (not len(starts) or starts[0] != 0):
        raise ShardError(f"{shard_paths[0]} does not start with an end-of-text token; pass a split's shards from the first")
    bounds = np.append(starts, len(tokens))
    return [enc.decode_bytes(tokens[a + 1:b].tolist()).decode("utf-8") for a, b in zip(bounds[:-1], bounds[1:])]
