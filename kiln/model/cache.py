"""The key/value cache that lets generation feed one new token per step instead of the whole context.

``cache = KVCache.for_model(model, batch)``; then ``model(idx, cache=cache)`` appends each layer's keys and values
and advances ``cache.pos``; both families use it the same way (kiln.model.gpt2, kiln.model.llama).
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every layer for ``batch`` rows, preallocated to ``max_len`` positions.

    All rows share one position (prompts of a batch have equal length). ``attend`` stores a layer's new keys and
    values at ``pos`` and returns everything cached so far plus the attention mask the new queries need.
    """

    def __init__(self, n_layer: int, batch: int, n_kv_head: int, max_len: int, head_dim: int,
                 device: torch.device | str, dtype: torch.dtype):
        self.k = torch.zeros(n_layer, batch, n_kv_head, max_len, head_dim, device=device, dtype=dtype)  # (L, B, nkv, S, hs)
        self.v = torch.zeros_like(self.k)  # (L, B, nkv, S, hs)
        self.max_len = max_len
        self.pos = 0  # positions filled (the same for every layer once a forward pass ends)

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch: int, max_len: int | None = None) -> "KVCache":
        cfg = model.config
        from kiln.model.families import of

        n_kv = of(cfg).parts.kv_heads(cfg)
        w = next(model.parameters())
        return cls(cfg.n_layer, batch, n_kv, max_len or cfg.block_size, cfg.head_dim, w.device, w.dtype)

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """k, v (B, nkv, T, hs) for the T new positions -> all keys, values (B, nkv, pos+T, hs) and a boolean mask
        (T, pos+T) that lets new query i see positions up to pos+i (None when T is 1: it sees everything)."""
        T = k.size(2)
        end = self.pos + T
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; {end} asked (start a new cache or crop the context)")
        self.k[layer, :, :, self.pos : end] = k
        self.v[layer, :, :, self.pos : end] = v
        mask = None
        if T > 1:
            mask = torch.ones(T, end, dtype=torch.bool, device=k.device).tril(diagonal=self.pos)  # (T, pos+T)
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end], mask

    def advance(self, T: int) -> None:
        """Called by the model once every layer has stored its T new positions."""
        self.pos += T

    def fork(self, repeats: int) -> "KVCache":
        """A cache of ``batch * repeats`` rows whose rows i*repeats ... (i+1)*repeats-1 start as copies of row i
        (every cached position), so a prompt prefilled once can be continued by several samples."""
        L, B, nkv, S, hs = self.k.shape
        out = KVCache(L, B * repeats, nkv, S, hs, self.k.device, self.k.dtype)  # (L, B*r, nkv, S, hs)
        out.k[:, :, :, : self.pos] = self.k[:, :, :, : self.pos].repeat_interleave(repeats, dim=1)
        out.v[:, :, :, : self.pos] = self.v[:, :, :, : self.pos].repeat_interleave(repeats, dim=1)
        out.pos = self.pos
        return out
