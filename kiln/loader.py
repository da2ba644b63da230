"""Deterministic, resumable, rank-sharded batches of token windows read from memory-mapped shards.

Use from Python: ``TokenLoader(shard_paths(dir, "train"), B, T, rank, world_size, seed).next_batch()``.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from kiln.shards import read_shard


class TokenStream:
    """The concatenation of shards as one token stream cut into windows of ``seq_len + 1`` tokens.

    Window ``w`` covers tokens ``[w*seq_len, w*seq_len + seq_len + 1)``: consecutive windows share
    one token (the last target of one is the first input of the next), so no token is lost.
    """

    def __init__(self, shard_paths: Sequence[str | os.PathLike], seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.paths = list(shard_paths)
        self.shards = [read_shard(p) for p in self.paths]
        self.offsets = np.cumsum([0] + [len(s) for s in self.shards])  # (S+1,) start of each shard
        self.n_tokens = int(self.offsets[-1])
        self.seq_len = seq_len
        self.n_windows = max(0, (self.n_tokens - 1) // seq_len)

    def fill(self, windows: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        """Write window ``windows[i]`` into row i of x (inputs) and y (targets); x, y: (len(windows), T)."""
        t = self.seq_len
        for i, w in enumerate(windows):
            start = int(w) * t
            k = int(np.searchsorted(self.offsets, start, side="right")) - 1
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

    Epoch ``e`` visits windows in ``permutation(seed, e)``. Global batch ``k`` is the
    ``G = batch_size * world_size`` windows ``perm[k*G:(k+1)*G]``; rank ``r`` takes
    ``perm[k*G + r*B : k*G + (r+1)*B]``. Windows left over at the end of an epoch (fewer than G)
    are skipped and the next epoch starts with a new permutation.

    Resume: ``state_dict()`` records the position in *windows* consumed in the epoch (plus epoch,
    batch index, seed and G). ``load_state_dict`` on a loader with the same G continues with exactly
    the batch that would have come next, whatever the split of G into ``batch_size * world_size``
    (e.g. 2 ranks x 4 resumes as 1 rank x 8: rank 0 of the new run gets both old ranks' rows, in
    rank order). With a different G it continues from the same window position of the same
    permutation, so no window of that epoch is repeated or skipped, but batches differ from the
    original run. The seed and the stream size (windows) come from the state and must match.
    """

    def __init__(self, shard_paths: Sequence[str | os.PathLike], batch_size: int, seq_len: int,
                 rank: int = 0, world_size: int = 1, seed: int = 0):
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size or seed < 0:
            raise ValueError(f"need batch_size >= 1, 0 <= rank < world_size, seed >= 0; got "
                             f"batch_size={batch_size} rank={rank} world_size={world_size} seed={seed}")
        self.stream = TokenStream(shard_paths, seq_len)
        self.batch_size, self.seq_len, self.rank, self.world_size, self.seed = batch_size, seq_len, rank, world_size, seed
        self.global_batch = batch_size * world_size  # windows per global batch
        if self.stream.n_windows < self.global_batch:
            raise ValueError(
                f"too few tokens for one global batch: {len(self.stream.paths)} shards hold {self.stream.n_tokens} "
                f"tokens = {self.stream.n_windows} windows of {seq_len}+1, but a global batch of "
                f"{batch_size} x {world_size} ranks x {seq_len} tokens needs {self.global_batch} windows "
                f"({self.global_batch * seq_len + 1} tokens)")
        self.epoch = 0
        self.window = 0  # windows of this epoch's permutation already consumed (all ranks together)
        self._perm: tuple[int, np.ndarray] | None = None

    @property
    def batches_per_epoch(self) -> int:
        return self.stream.n_windows // self.global_batch

    def _permutation(self) -> np.ndarray:
        if self._perm is None or self._perm[0] != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._perm = (self.epoch, rng.permutation(self.stream.n_windows))
        return self._perm[1]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next (x, y): int64 tensors of shape (B, T), y[i, t] = x[i, t+1] in the stream."""
        if self.window + self.global_batch > self.stream.n_windows:
            self.epoch, self.window = self.epoch + 1, 0
        start = self.window + self.rank * self.batch_size
        windows = self._permutation()[start:start + self.batch_size]  # (B,)
        x = np.empty((self.batch_size, self.seq_len), dtype=np.int64)  # (B, T)
        y = np.empty_like(x)  # (B, T)
        self.stream.fill(windows, x, y)
        self.window += self.global_batch
        return torch.from_numpy(x), torch.from_numpy(y)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.window // self.global_batch, "window": self.window,
                "seed": self.seed, "global_batch": self.global_batch, "seq_len": self.seq_len,
                "n_windows": self.stream.n_windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, mine in (("seq_len", self.seq_len), ("n_windows", self.stream.n_windows)):
            if key in state and int(state[key]) != mine:
                raise ValueError(f"loader state has {key}={state[key]} but this loader has {mine}: "
                                 "the shards or sequence length changed since the state was saved")
        window = int(state["window"]) if "window" in state else int(state["batch"]) * int(state["global_batch"])
        self.epoch, self.window, self.seed = int(state["epoch"]), window, int(state["seed"])
        self._perm = None


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
