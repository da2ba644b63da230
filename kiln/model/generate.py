"""One generation loop for every model family: prefill the prompts into a KV cache, then feed one token per step.

``generate(model, idx, max_new_tokens, temperature=0.0, top_k=None, stop_token=eot, n_vocab=enc.n_vocab)`` extends
idx (B, T). ``kiln generate``, the lm-eval adapter's ``generate_until``, the sample generations and the RL rollouts
(kiln.posttrain.sampling.complete) all decode through it; ``samples=8`` decodes each prompt 8 times from one prefill
(its KV cache forked, KVCache.fork). Compare with the uncached loop: ``python bench/bench_generate.py``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.model.cache import KVCache

StopFn = Callable[[int, list[int]], bool]  # (row, its new tokens so far) -> True ends the row


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) -> ids (B,): the argmax at temperature <= 0, else one draw per row from
    softmax(logits / temperature), kept to the top_k largest logits when top_k is set.

    Every row draws over the full width V each call (one ``torch.multinomial`` of (B, V)), so a row's random
    numbers depend only on its index and the step, never on which other rows have stopped."""
    if temperature <= 0:
        return logits.argmax(dim=-1)  # (B,)
    logits = logits / temperature  # (B, V)
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)  # (B,)


class _Context:
    """Next-token logits of each row's last ``window`` tokens: through a KV cache while the context fits in the
    window, then (exactly as an uncached loop) a full forward pass of the cropped window per step.

    With ``samples`` > 1 the rows come in runs of ``samples`` copies of one prompt: the first (prefill) pass runs
    one row per run, and its cache is then forked to every row of the run (KVCache.fork)."""

    def __init__(self, model: nn.Module, batch: int, window: int, use_cache: bool, samples: int = 1,
                 length: int | None = None):
        self.model, self.window, self.samples = model, window, samples
        # the cache holds the positions this call can fill (prompt + new tokens), not the model's whole context: a
        # model with an 8k context and 64 rows would otherwise allocate gigabytes it never uses
        cache_len = min(window, length) if length else window
        self.cache = KVCache.for_model(model, batch // samples, max_len=cache_len) if use_cache else None

    def logits(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        """buf (B, >=n) tokens, the first n of them real -> logits (B, V) of the position after them."""
        if self.cache is not None and n <= self.window:
            if self.samples > 1:  # the prefill: each prompt once, then its cache and logits copied to its samples
                logits = self.model(buf[:: self.samples, :n], cache=self.cache)[:, -1]  # (B / samples, V)
                self.cache, repeats, self.samples = self.cache.fork(self.samples), self.samples, 1
                return logits.repeat_interleave(repeats, dim=0)  # (B, V)
            return self.model(buf[:, self.cache.pos : n], cache=self.cache)[:, -1]  # prefill, then one token a step
        self.cache = None  # past the window every step re-reads the cropped window; the cache is of no more use
        return self.model(buf[:, max(0, n - self.window) : n])[:, -1]  # (B, V)


def _ended_by(stop: StopFn, new: list[list[int]], tokens: list[int], drew: list[bool],
              stop_token: int | None) -> list[int]:
    """Rows that ``stop`` ends after this step's tokens; ``new`` gets each drawing row's token (a stop token ends
    the row by itself and is not added)."""
    ended = []
    for i, (t, d) in enumerate(zip(tokens, drew)):
        if d and t != stop_token:
            new[i].append(t)
            if stop(i, new[i]):
                ended.append(i)
    return ended


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    stop_token: int | None = None,
    n_vocab: int | None = None,
    generator: torch.Generator | None = None,
    lengths: Sequence[int] | None = None,
    window: int | None = None,
    stop: StopFn | None = None,
    use_cache: bool = True,
    samples: int = 1,
) -> torch.Tensor:
    """Extend every row of idx (B, T) by up to max_new_tokens; returns (B, T + steps) with the prompts first.

    Temperature 0 is greedy; ids from ``n_vocab`` up (the embedding's padding) are never drawn. A row that emits
    ``stop_token``, or that ``stop`` ends, emits ``stop_token`` (0 without one) from then on, and decoding ends
    once every row has ended. The context is each row's last ``window`` tokens (default block_size), as if it
    were cropped every step. Rows of different lengths: right-pad idx and give ``lengths``; row i's new tokens
    are out[i, lengths[i] : lengths[i] + max_new_tokens] (its prompt is fed one token a step past the shortest
    one). ``use_cache=False`` recomputes the whole window every step (same tokens, no cache). ``samples`` > 1 decodes
    each row of idx that many times: rows i*samples ... (i+1)*samples-1 of the output (and the row numbers ``stop``
    sees) continue prompt i, which is prefilled once and its KV cache forked; the tokens are those of idx with each
    row repeated ``samples`` times (``lengths`` gives one length per prompt)."""
    if samples < 1:
        raise ValueError(f"generate: samples must be >= 1, got {samples}")
    B, T = idx.shape
    W = window or model.config.block_size
    if not 1 <= W <= model.config.block_size:
        raise ValueError(f"generate: window={W} must be between 1 and model.block_size={model.config.block_size}")
    lens = torch.full((B,), T, device=idx.device) if lengths is None else torch.as_tensor(lengths, device=idx.device)
    if T == 0 or int(lens.min()) < 1 or int(lens.max()) > T:
        raise ValueError(f"generate: every prompt needs 1 to {T} tokens (idx is {tuple(idx.shape)}), got lengths {lens.tolist()}")
    if samples > 1:
        idx, lens, B = idx.repeat_interleave(samples, dim=0), lens.repeat_interleave(samples), B * samples  # (B*S, T)
    if max_new_tokens <= 0:
        return idx
    fill = 0 if stop_token is None else stop_token
    n, end = int(lens.min()), T + max_new_tokens
    buf = torch.full((B, end), fill, dtype=idx.dtype, device=idx.device)  # (B, T + max_new)
    buf[:, :T] = idx
    done = torch.zeros(B, dtype=torch.bool, device=idx.device)  # (B,) rows that have ended
    new: list[list[int]] = [[] for _ in range(B)]
    ctx = _Context(model, B, W, use_cache, samples, length=end)
    while n < end:
        logits = ctx.logits(buf, n)  # (B, V)
        if n_vocab is not None:
            logits[:, n_vocab:] = float("-inf")
        nxt = next_token(logits, temperature, top_k, generator)  # (B,)
        drew = (lens <= n) & ~done  # (B,) rows past their prompt that are still going
        nxt = torch.where(lens <= n, torch.where(done, fill, nxt), buf[:, n])  # prompt tokens until each row's own end
        buf[:, n] = nxt
        ended = _ended_by(stop, new, nxt.tolist(), drew.tolist(), stop_token) if stop is not None else []
        if stop_token is not None:
            done |= drew & (nxt == stop_token)
        if ended:
            done[ended] = True
        n += 1
        done |= n - lens >= max_new_tokens  # the row's budget is spent
        if bool(done.all()):
            break
    return buf[:, :n]
