"""Tests for kiln.model.generate: the KV-cached loop gives the uncached loop's tokens for both families (greedy and
seeded sampling, per-row stops, padding ids, contexts past the window, ragged rows, one row and many), and samples of
one prompt from one prefill and a forked cache give the tokens of the prompt's repeated rows.

Run: python -m pytest tests/kiln/model/test_generate.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.model.cache import KVCache
from kiln.model.config import ModelConfig
from kiln.model.families import build_model
from kiln.model.generate import generate, next_token

FAMILIES = {
    "gpt2": dict(vocab_size=300, block_size=32, n_layer=2, n_head=2, n_embd=32),
    "llama": dict(family="llama", vocab_size=300, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32),
    # the router runs at every generated token: the cache must give the tokens the whole window gives
    "moe": dict(family="moe", vocab_size=300, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                n_experts=4, n_experts_per_token=2),
}


def make(family: str = "gpt2", **kw) -> nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(**{**FAMILIES[family], **kw})).eval()


@torch.no_grad()
def uncached_loop(model, x, max_new_tokens, temperature=0.0, top_k=None, stop_token=None, generator=None,
                  n_vocab=None, window=None):
    """The loop kiln.posttrain.sampling.sample ran before the cache (plus GPT.generate's top_k): crop to the last
    window tokens, one full forward pass a step, every row drawing over the full width."""
    window = window or model.config.block_size
    done = torch.zeros(x.size(0), dtype=torch.bool)
    for _ in range(max_new_tokens):
        logits = model(x[:, -window:])[:, -1, :]  # (B, V)
        if n_vocab is not None:
            logits[:, n_vocab:] = float("-inf")
        if temperature <= 0:
            nxt = logits.argmax(dim=-1)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)
        if stop_token is not None:
            nxt = torch.where(done, torch.full_like(nxt, stop_token), nxt)
            done |= nxt == stop_token
        x = torch.cat([x, nxt[:, None]], dim=1)
        if bool(done.all()):
            break
    return x


def prompts(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 300, (batch, length), generator=torch.Generator().manual_seed(seed))  # (B, T)


# ---- GPT.generate's tests, through the shared loop ---------------------------------
def test_greedy_generate_is_deterministic_and_uses_the_argmax() -> None:
    m = make()
    start = torch.tensor([[1, 2, 3]])
    out = generate(m, start, max_new_tokens=5, temperature=0)
    assert out.shape == (1, 8)
    assert torch.equal(out[:, :3], start)
    assert torch.equal(out, generate(m, start, max_new_tokens=5, temperature=0))
    with torch.no_grad():
        assert out[0, 3].item() == m(start)[0, -1].argmax().item()


def test_generate_stops_at_stop_token_and_crops_context() -> None:
    m = make()
    start = torch.tensor([[5]])
    first = generate(m, start, 1, temperature=0)[0, -1].item()
    out = generate(m, start, max_new_tokens=10, temperature=0, stop_token=first)
    assert out.tolist() == [[5, first]]
    # a prompt longer than block_size is cropped rather than rejected
    long = torch.randint(0, 300, (1, 40))
    assert generate(m, long, 2, temperature=0).shape == (1, 42)


def test_sampling_with_top_k_1_equals_greedy() -> None:
    m = make()
    start = torch.tensor([[4, 9]])
    g = torch.Generator().manual_seed(0)
    assert torch.equal(generate(m, start, 6, temperature=1.0, top_k=1, generator=g), generate(m, start, 6, temperature=0))


# ---- cached == uncached -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2", "llama", "moe"])
@pytest.mark.parametrize("batch", [1, 6])
@pytest.mark.parametrize("temperature,top_k", [(0.0, None), (1.0, None), (0.8, 20)])
def test_cached_generation_gives_the_uncached_tokens(family: str, batch: int, temperature: float, top_k) -> None:
    m = make(family)
    x = prompts(batch, 7)
    outs = []
    for fn in (lambda g: generate(m, x, 12, temperature=temperature, top_k=top_k, generator=g),
               lambda g: generate(m, x, 12, temperature=temperature, top_k=top_k, generator=g, use_cache=False),
               lambda g: uncached_loop(m, x, 12, temperature, top_k, generator=g)):
        outs.append(fn(torch.Generator().manual_seed(3)))
    assert outs[0].shape == (batch, 19)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    if temperature > 0:  # the seed matters: another one draws other tokens
        assert not torch.equal(outs[0], generate(m, x, 12, temperature=temperature, top_k=top_k,
                                                 generator=torch.Generator().manual_seed(4)))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_per_row_stop_keeps_emitting_stop_and_ends_when_every_row_has(family: str) -> None:
    m = make(family)
    x = prompts(4, 5, seed=2)
    free = generate(m, x, 10)[:, 5:].tolist()  # (4, 10) without a stop token
    stop = free[0][2]  # row 0 emits it at its third step
    out = generate(m, x, 10, stop_token=stop)
    assert torch.equal(out, uncached_loop(m, x, 10, stop_token=stop))
    firsts = [row.index(stop) if stop in row else None for row in free]
    steps = 10 if None in firsts else max(firsts) + 1
    assert out.shape == (4, 5 + steps)
    for row, first, got in zip(free, firsts, out[:, 5:].tolist()):
        cut = steps if first is None else first
        assert got[:cut] == row[:cut]  # the same tokens up to the row's stop
        assert all(t == stop for t in got[cut:])  # then only stop tokens
    # a stop token no row emits: every row runs its whole budget
    unused = next(t for t in range(300) if all(t not in row for row in free))
    assert generate(m, x, 10, stop_token=unused).shape == (4, 15)


def test_seeded_sampling_with_stops_matches_the_uncached_loop_draw_for_draw() -> None:
    m = make()
    x = prompts(8, 4, seed=5)
    g1, g2 = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    free = uncached_loop(m, x, 12, 1.0, generator=torch.Generator().manual_seed(11))[:, 4:]
    stop = int(free[0, 1])  # common enough in this stream to stop some rows early
    a = generate(m, x, 12, temperature=1.0, stop_token=stop, generator=g1, n_vocab=290)
    b = uncached_loop(m, x, 12, 1.0, stop_token=stop, generator=g2, n_vocab=290)
    assert torch.equal(a, b)
    assert torch.equal(g1.get_state(), g2.get_state())  # the same multinomial calls: the generators agree afterwards


class PaddingLover(nn.Module):
    """Wraps a model so the ids from ``n_vocab`` up (the embedding's padding) have by far the largest logits."""

    def __init__(self, inner: nn.Module, n_vocab: int):
        super().__init__()
        self.inner, self.config, self.n_vocab = inner, inner.config, n_vocab

    def forward(self, idx, cache=None):
        logits = self.inner(idx, cache=cache)  # (B, T, V)
        logits[..., self.n_vocab :] += 100.0
        return logits


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_padding_ids_are_never_drawn(family: str) -> None:
    m = PaddingLover(make(family), n_vocab=256)
    x = prompts(5, 3)
    assert (generate(m, x, 8)[:, 3:] >= 256).all()  # without n_vocab the padding wins
    for temperature, top_k in ((0.0, None), (1.0, None), (2.0, 5)):
        out = generate(m, x, 8, temperature=temperature, top_k=top_k, n_vocab=256,
                       generator=torch.Generator().manual_seed(0))[:, 3:]
        assert out.shape == (5, 8) and (out < 256).all()


# ---- contexts past the window -------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("length", [20, 25, 40])
def test_window_overflow_gives_the_cropping_loops_tokens(family: str, length: int) -> None:
    m = make(family)  # block_size 32: 12 new tokens after 20 fill it exactly, after 25 run past it, 40 start past it
    x = prompts(3, length)
    for temperature in (0.0, 1.0):
        a = generate(m, x, 12, temperature=temperature, generator=torch.Generator().manual_seed(7))
        b = uncached_loop(m, x, 12, temperature, generator=torch.Generator().manual_seed(7))
        assert a.shape == (3, length + 12) and torch.equal(a, b)
    # a window shorter than block_size (the lm-eval adapter's max_length) crops there instead
    assert torch.equal(generate(m, x, 12, window=10), uncached_loop(m, x, 12, window=10))


# ---- ragged rows --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_rows_of_different_lengths_decode_as_they_would_alone(family: str) -> None:
    m = make(family)
    rows = [prompts(1, n, seed=n)[0].tolist() for n in (3, 9, 6, 30)]  # the last one runs past block_size 32
    T = max(map(len, rows))
    x = torch.tensor([r + [0] * (T - len(r)) for r in rows])  # (4, T) right-padded
    out = generate(m, x, 8, lengths=[len(r) for r in rows]).tolist()
    for r, got in zip(rows, out):
        alone = generate(m, torch.tensor([r]), 8)[0].tolist()
        assert got[: len(r) + 8] == alone
    # with a stop token each row's tail after its own 8 tokens is stop tokens
    out = generate(m, x, 8, lengths=[len(r) for r in rows], stop_token=299)
    assert out.shape == (4, T + 8) and all(t == 299 for r, o in zip(rows, out.tolist()) for t in o[len(r) + 8 :])


def test_a_stop_function_ends_its_row_and_sees_only_the_new_tokens() -> None:
    m = make()
    x = prompts(3, 4)
    free = generate(m, x, 10)[:, 4:].tolist()
    seen: list[tuple[int, list[int]]] = []

    def stop(row: int, new: list[int]) -> bool:
        seen.append((row, list(new)))
        return row == 1 and len(new) == 3

    out = generate(m, x, 10, stop_token=299, stop=stop)[:, 4:].tolist()
    assert out[1] == free[1][:3] + [299] * 7
    assert out[0] == free[0] and out[2] == free[2]
    assert (1, free[1][:3]) in seen and not any(r == 1 and len(n) > 3 for r, n in seen)
    assert (0, free[0]) in seen  # rows that never stop are shown all their tokens


# ---- one prefill per prompt, its cache forked to the samples -----------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("temperature,top_k", [(0.0, None), (1.0, None), (0.8, 20)])
def test_samples_decode_each_prompt_as_its_repeated_rows_would(family: str, temperature: float, top_k) -> None:
    """One prefill per prompt, then its forked cache: the tokens, and the draws from the generator, of a batch of
    each prompt repeated ``samples`` times (the RL groups' old batches)."""
    m = make(family)
    x = prompts(3, 7)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = generate(m, x, 12, temperature=temperature, top_k=top_k, generator=g1, samples=4, stop_token=17, n_vocab=290)
    b = generate(m, x.repeat_interleave(4, dim=0), 12, temperature=temperature, top_k=top_k, generator=g2,
                 stop_token=17, n_vocab=290)
    assert a.shape[0] == 12 and torch.equal(a, b)
    assert torch.equal(g1.get_state(), g2.get_state())
    if temperature > 0:
        assert len({tuple(r) for r in a[:4].tolist()}) > 1  # the samples of one prompt differ


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_samples_with_ragged_rows_past_the_window_and_uncached(family: str) -> None:
    m = make(family)
    rows = [prompts(1, n, seed=n)[0].tolist() for n in (3, 9, 30)]  # the last one runs past block_size 32
    T = max(map(len, rows))
    x = torch.tensor([r + [0] * (T - len(r)) for r in rows])  # (3, T)
    lens = [len(r) for r in rows]
    for kw in ({}, {"use_cache": False}, {"window": 8}):
        a = generate(m, x, 8, temperature=1.0, lengths=lens, samples=2, generator=torch.Generator().manual_seed(1), **kw)
        b = generate(m, x.repeat_interleave(2, dim=0), 8, temperature=1.0, lengths=[n for n in lens for _ in "ab"],
                     generator=torch.Generator().manual_seed(1), **kw)
        assert torch.equal(a, b), kw
    assert torch.equal(generate(m, prompts(2, 3), 0, samples=3), prompts(2, 3).repeat_interleave(3, dim=0))
    with pytest.raises(ValueError, match="samples must be >= 1"):
        generate(m, prompts(1, 3), 2, samples=0)


def test_bad_windows_and_prompts_are_errors() -> None:
    m = make()
    with pytest.raises(ValueError, match="window=33"):
        generate(m, prompts(1, 3), 2, window=33)
    with pytest.raises(ValueError, match="every prompt needs"):
        generate(m, prompts(2, 3), 2, lengths=[3, 0])
    assert torch.equal(generate(m, prompts(2, 3), 0), prompts(2, 3))


def test_next_token_greedy_and_top_k() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert next_token(logits, 0.0).tolist() == [1]
    g = torch.Generator().manual_seed(0)
    draws = {next_token(logits, 1.0, top_k=2, generator=g).item() for _ in range(200)}
    assert draws == {1, 3}


@pytest.mark.parametrize("samples", [1, 3])
def test_the_cache_holds_what_the_call_can_fill_not_the_whole_context(monkeypatch, samples: int) -> None:
    """A model with a long context and many rows: the KV cache is sized to prompt + new tokens (a model with an 8k
    context and 64 prompts would otherwise allocate gigabytes per call); the tokens are those of the uncached loop."""
    made = []
    real = KVCache.for_model.__func__

    def spy(cls, model, batch, max_len=None):
        made.append((batch, max_len))
        return real(cls, model, batch, max_len)

    monkeypatch.setattr(KVCache, "for_model", classmethod(spy))
    torch.manual_seed(0)
    model = make("llama", block_size=512)
    x = prompts(2, 7)
    out = generate(model, x, 5, samples=samples)
    assert made == [(2, 12)]
    want = generate(model, x, 5, samples=samples, use_cache=False)
    assert torch.equal(out, want)
