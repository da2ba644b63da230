"""Token shards in llm.c's layout (1024-byte int32 header, then uint16/uint32 tokens) with a checksummed manifest.

Use from Python: ``write_shards(enc, docs, out_dir, ...)`` then ``verify_shards(out_dir)`` and ``read_shard(path)``.
"""

from __future__ import annotations

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

from kiln.storage import atomic_path, atomic_write_json, sha256_bytes, sha256_file
from kiln.tokenizer import encoding_fingerprint

MAGIC = 20240520
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
VERSIONS = {1: np.dtype("<u2"), 2: np.dtype("<u4")}  # llm.c: version 1 = uint16 tokens, 2 = uint32
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
BATCH_CHARS = 1 << 18  # text handed to one encode task


class ShardError(ValueError):
    """A shard or manifest is missing, truncated, corrupt or inconsistent; the message names the file."""


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
    """[EOT, doc0 tokens..., EOT, doc1 tokens..., ...] as one flat array of ``dtype``."""
    flat: list[int] = []
    for text in texts:
        flat.append(enc.eot_token)
        flat.extend(enc.encode_ordinary(text))  # Rust, releases the GIL
    return np.array(flat, dtype=dtype)


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
    read-ahead: ``executor="thread"`` (default; tiktoken's Rust encoder releases the GIL, and the
    list-to-array step runs in the workers too) measured at raw ``encode_ordinary_batch`` speed on
    2 cores, while a spawned ``"process"`` pool was 5-12x slower on 3-9 MB (mostly start-up,
    bench/bench_shards.py); the process pool is for many-core machines and needs an importable
    ``__main__``. ``dtype`` forces the token type (default: ``shard_dtype(enc.n_vocab)``).
    ``progress(documents_done, tokens_done)`` is called after each encoded batch. Every shard and
    ``manifest.json`` are written atomically; ``out_dir`` must hold no shards yet. The manifest
    lists per shard file, split, tokens, bytes, sha256 and documents (documents *starting* in it,
    i.e. its EOT count), plus per-split totals, dtype, vocab size and the encoding fingerprint.
    """
    out_dir = Path(out_dir)
    if shard_tokens < 1 or not 0 <= val_permille <= 1000:
        raise ValueError(f"shard_tokens must be >= 1 and val_permille in [0, 1000]; got {shard_tokens}, {val_permille}")
    dt = np.dtype(dtype).newbyteorder("<") if dtype is not None else shard_dtype(enc.n_vocab)
    if dt not in VERSIONS.values():
        raise ValueError(f"shard dtype must be uint16 or uint32, got {dt}")
    if enc.max_token_value > np.iinfo(dt).max:
        raise ShardError(f"vocabulary of {enc.n_vocab} tokens is larger than {dt.name} shards can hold")
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.glob("*.bin")) or (out_dir / MANIFEST).exists():
        raise ShardError(f"{out_dir} already holds shards; write into an empty folder")

    counts = {s: 0 for s in SPLITS}
    buffers: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    buffered = {s: 0 for s in SPLITS}
    shards: list[dict[str, Any]] = []
    n_index = {s: 0 for s in SPLITS}
    eot = enc.eot_token

    def emit(split: str, tokens: np.ndarray) -> None:
        name = f"{split}_{n_index[split]:06d}.bin"
        data = shard_header(len(tokens), dt) + tokens.astype(dt, copy=False).tobytes()
        with atomic_path(out_dir / name) as tmp:
            tmp.write_bytes(data)
        shards.append({"file": name, "split": split, "tokens": int(len(tokens)), "bytes": len(data),
                       "sha256": sha256_bytes(data), "documents": int(np.count_nonzero(tokens == eot))})
        n_index[split] += 1

    def flush(split: str, final: bool) -> None:
        if buffered[split] < shard_tokens and not (final and buffered[split]):
            return
        tokens = np.concatenate(buffers[split])
        cut = len(tokens) if final else len(tokens) - len(tokens) % shard_tokens
        for start in range(0, cut, shard_tokens):
            emit(split, tokens[start:min(start + shard_tokens, cut)])
        buffers[split] = [tokens[cut:]] if cut < len(tokens) else []
        buffered[split] = len(tokens) - cut

    tasks = _tasks(docs, val_permille, counts)
    done_docs = done_tokens = 0
    pool: Executor | None = None
    try:
        if num_workers <= 1:
            results: Iterator[tuple[str, np.ndarray]] = ((s, _encode_docs(t, enc, dt)) for s, t in tasks)
        elif executor == "thread":
            pool = ThreadPoolExecutor(num_workers)
            results = _pooled(pool, functools.partial(_encode_docs, enc=enc, dtype=dt), tasks, 2 * num_workers)
        elif executor == "process":
            pool = ProcessPoolExecutor(num_workers, mp.get_context("spawn"), _init_worker, (enc, dt.str))
            results = _pooled(pool, _encode_task, tasks, 2 * num_workers)
        else:
            raise ValueError(f"executor must be 'process' or 'thread', got {executor!r}")
        for split, arr in results:
            buffers[split].append(arr)
            buffered[split] += len(arr)
            done_tokens += len(arr)
            done_docs += int(np.count_nonzero(arr == eot))
            flush(split, final=False)
            if progress is not None:
                progress(done_docs, done_tokens)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    if not sum(counts.values()):
        raise ShardError(f"write_shards: no documents to write into {out_dir} (empty input)")
    for split in SPLITS:
        flush(split, final=True)

    totals = {s: {"shards": 0, "tokens": 0, "bytes": 0, "documents": counts[s]} for s in SPLITS}
    for sh in shards:
        t = totals[sh["split"]]
        t["shards"] += 1
        t["tokens"] += sh["tokens"]
        t["bytes"] += sh["bytes"]
    manifest = {
        "format": "llm.c", "magic": MAGIC, "version": 1 if dt.itemsize == 2 else 2, "header_bytes": HEADER_BYTES,
        "dtype": dt.name, "vocab_size": enc.n_vocab, "eot_token": eot, "encoding": enc.name,
        "encoding_fingerprint": encoding_fingerprint(enc), "shard_tokens": shard_tokens,
        "val_permille": val_permille, "split_rule": "sha256(doc id)[:8] big-endian mod 1000 < val_permille",
        "documents": dict(counts), "splits": totals, "shards": shards,
    }
    atomic_write_json(out_dir / MANIFEST, manifest)
    return manifest


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
            raise ShardError(f"shard {path}: checksum mismatch, sha256 {got} but the manifest says {expected_sha256}")
    if n_tokens == 0:
        return np.zeros(0, dtype=dt)  # memmap cannot map zero bytes
    return np.memmap(path, dtype=dt, mode="r", offset=HEADER_BYTES, shape=(n_tokens,))


def load_manifest(shard_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(shard_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest, dict) or "shards" not in manifest:
            raise ValueError("no 'shards' list")
    except (OSError, ValueError) as e:
        raise ShardError(f"cannot read shard manifest {path}: {e}") from e
    return manifest


def shard_paths(shard_dir: str | os.PathLike, split: str) -> list[Path]:
    """Paths of one split's shards in manifest order."""
    return [Path(shard_dir) / s["file"] for s in load_manifest(shard_dir)["shards"] if s["split"] == split]


def verify_shards(shard_dir: str | os.PathLike) -> dict[str, Any]:
    """Check every shard named in the manifest exists and matches its size, checksum and token count."""
    shard_dir = Path(shard_dir)
    manifest = load_manifest(shard_dir)
    for sh in manifest["shards"]:
        path = shard_dir / sh["file"]
        if not path.exists():
            raise ShardError(f"shard {sh['file']} named in {shard_dir / MANIFEST} is missing from {shard_dir}")
        tokens = read_shard(path, sh["sha256"], manifest.get("vocab_size"))
        if len(tokens) != sh["tokens"] or tokens.dtype.name != manifest["dtype"]:
            raise ShardError(f"shard {path}: {len(tokens)} {tokens.dtype.name} tokens, "
                             f"manifest says {sh['tokens']} {manifest['dtype']}")
    return manifest


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
