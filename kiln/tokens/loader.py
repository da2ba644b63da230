"""Deterministic, resumable, rank-sharded batches of token windows read from memory-mapped shards.

Use from Python: ``TokenLoader(shard_paths(dir, "train"), B, T, rank, world_size, seed).next_batch()``.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from kiln.tokens.shards import check_shard_files, read_shard


class TokenStream:
    """The concatenation of shards as one token stream cut into windows of ``seq_len + 1`` tokens.

    Window ``w`` covers tokens ``[w*seq_len, w*seq_len + seq_len + 1)``: consecutive windows share
    one token (the last target of one is the first input of the next), so the inputs of all windows
    tile the stream: every token but the final < ``seq_len`` of the tail is an input exactly once.
    Shards sitting beside a ``manifest.json`` are checked against it first (sizes, token counts,
    sha256, with hashes remembered per unchanged file: see ``kiln.tokens.shards.verify_shards``).
    """

    def __init__(self, shard_paths: Sequence[str | os.PathLike], seq_len: int, verify: bool = True):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.paths = list(shard_paths)
        if not self.paths:
            raise ValueError("no shard files given: pass the paths of a split's shards (kiln.tokens.shards.shard_paths)")
        if verify:
            check_shard_files(self.paths)
        # plain ndarray views of the memory maps: slicing an np.memmap costs more than copying a window
        self.shards = [read_shard(p).view(np.ndarray) for p in self.paths]
        self.offsets = np.cumsum([0] + [len(s) for s in self.shards])  # (S+1,) start of each shard
        self.n_tokens = int(self.offsets[-1])
        self.seq_len = seq_len
        self.n_windows = max(0, (self.n_tokens - 1) // seq_len)

    def fill(self, windows: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        """Write window ``windows[i]`` into row i of x (inputs) and y (targets); x, y: (len(windows), T)."""
        t = self.seq_len
        starts = np.asarray(windows, dtype=np.int64) * t  # (n,) first token of each window in the stream
        ks = np.searchsorted(self.offsets, starts, side="right") - 1  # (n,) shard holding that token
        for i, (start, k) in enumerate(zip(starts.tolist(), ks.tolist())):
            local = start - int(self.offsets[k])
            shard = self.shards[k]
            if local + t + 1 <= len(shard):
                win = shard[local:local + t + 1]  # (T+1,) fast path: inside one shard
            else:
                parts, need = [], t + 1
                while need:
                    piece = self.shards[k][local:local + need]
                    parts.append(piece)
                    need -= len(piece)
                    k, local = k + 1, 0
                win = np.concatenate(parts)  # (T+1,) window spanning shards
            x[i] = win[:-1]
            y[i] = win[1:]


class TokenLoader:
    """Random non-overlapping windows, a fresh permutation per epoch, each rank a disjoint slice.

    The windows are read in the order of one endless sequence, ``permutation(seed, 0)`` followed by
    ``permutation(seed, 1)`` and so on (one permutation of all windows per epoch). Global batch
    ``k`` is the ``G = batch_size * world_size`` windows at positions ``[k*G, (k+1)*G)`` of that
    sequence, and rank ``r`` takes positions ``[k*G + r*B, k*G + (r+1)*B)``. So within an epoch the
    ranks never share a window, every window is read exactly once per epoch, and nothing is dropped
    at an epoch's end: a batch may take its last windows of one epoch and the first of the next.

    Resume: ``state_dict()`` records the position (epoch, windows of that epoch already read by all
    ranks together) and the seed. ``load_state_dict`` continues from exactly that position, on any
    number of ranks and any batch size: with the same G the batches equal those of the uninterrupted
    run (2 ranks x 4 resumed as 1 rank x 8 gives rank 0 both old ranks' rows, in rank order); with
    another G the batches are cut differently from the same sequence, so still no window is skipped
    or read twice. The state also records the stream size and ``seq_len``, which must match.
    """

    def __init__(self, shard_paths: Sequence[str | os.PathLike], batch_size: int, seq_len: int,
                 rank: int = 0, world_size: int = 1, seed: int = 0, verify: bool = True):
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size or seed < 0:
            raise ValueError(f"need batch_size >= 1, 0 <= rank < world_size, seed >= 0; got "
                             f"batch_size={batch_size} rank={rank} world_size={world_size} seed={seed}")
        self.stream = TokenStream(shard_paths, seq_len, verify)
        self.batch_size, self.seq_len, self.rank, self.world_size, self.seed = batch_size, seq_len, rank, world_size, seed
        self.global_batch = batch_size * world_size  # windows per global batch
        if self.stream.n_windows < self.global_batch:
            raise ValueError(
                f"too few tokens for one global batch: {len(self.stream.paths)} shards hold {self.stream.n_tokens} "
                f"tokens = {self.stream.n_windows} windows of {seq_len}+1, but a global batch of "
                f"{batch_size} x {world_size} ranks x {seq_len} tokens needs {self.global_batch} windows "
                f"({self.global_batch * seq_len + 1} tokens)")
        self.position = 0  # windows of the endless sequence already read, all ranks together
        self._perm: dict[int, np.ndarray] = {}

    @property
    def epoch(self) -> int:
        return self.position // self.stream.n_windows

    @property
    def window(self) -> int:
        """Windows of the current epoch already read (all ranks together)."""
        return self.position % self.stream.n_windows

    @property
    def batches_per_epoch(self) -> float:
        return self.stream.n_windows / self.global_batch

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm:
            if len(self._perm) > 1:
                self._perm.pop(min(self._perm))  # a batch touches at most two epochs
            self._perm[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.stream.n_windows)
        return self._perm[epoch]

    def windows_at(self, start: int, count: int) -> np.ndarray:
        """Window ids at positions ``[start, start + count)`` of the endless sequence: (count,) int64."""
        n = self.stream.n_windows
        out, pos = [], start
        while pos < start + count:
            epoch, off = divmod(pos, n)
            take = min(n - off, start + count - pos)
            out.append(self._permutation(epoch)[off:off + take])
            pos += take
        return np.concatenate(out)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next (x, y): int64 tensors of shape (B, T), y[i, t] = x[i, t+1] in the stream."""
        windows = self.windows_at(self.position + self.rank * self.batch_size, self.batch_size)  # (B,)
        x = np.empty((self.batch_size, self.seq_len), dtype=np.int64)  # (B, T)
        y = np.empty_like(x)  # (B, T)
        self.stream.fill(windows, x, y)
        self.position += self.global_batch
        return torch.from_numpy(x), torch.from_numpy(y)

    def state_dict(self) -> dict[str, int]:
        """Plain ints: where the next batch starts, and what the state is only valid for."""
        return {"epoch": self.epoch, "window": self.window, "batch": self.position // self.global_batch,
                "seed": self.seed, "global_batch": self.global_batch, "seq_len": self.seq_len,
                "n_windows": self.stream.n_windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from any loader over the same shards and ``seq_len``, any world size)."""
        for key, mine in (("seq_len", self.seq_len), ("n_windows", self.stream.n_windows)):
            if key in state and int(state[key]) != mine:
                raise ValueError(f"loader state has {key}={state[key]} but this loader has {mine}: "
                                 "the shards or sequence length changed since the state was saved")
        window = int(state["window"]) if "window" in state else int(state["batch"]) * int(state["global_batch"])
        if not 0 <= window < self.stream.n_windows:
            raise ValueError(f"loader state has window={window}, outside this stream's {self.stream.n_windows} windows")
        self.position = int(state["epoch"]) * self.stream.n_windows + window
        self.seed = int(state["seed"])
        self._perm = {}


def iter_eval_batches(shard_paths: Sequence[str | os.PathLike], batch_size: int, seq_len: int,
                      max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Validation batches: windows 0, 1, 2, ... in order, ``batch_size`` per batch, at most ``max_batches``.

    Every rank gets the same batches (so every rank computes the same validation loss without a
    reduction). The last batch may have fewer than ``batch_size`` rows.
    """
    stream = TokenStream(shard_paths, seq_len)
    if stream.n_windows == 0:
        raise ValueError(f"validation shards ({len(stream.paths)} files, {stream.n_tokens} tokens) are too short "
                         f"for one window of {seq_len}+1 tokens")
    n_batches = -(-stream.n_windows // batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for b in range(n_batches):
        windows = np.arange(b * batch_size, min((b + 1) * batch_size, stream.n_windows))  # (b,)
        x = np.empty((len(windows), seq_len), dtype=np.int64)  # (b, T)
        y = np.empty_like(x)  # (b, T)
        stream.fill(windows, x, y)
        yield torch.from_numpy(x), torch.from_numpy(y)
