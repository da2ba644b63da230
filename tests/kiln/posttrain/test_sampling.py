"""Tests of kiln/posttrain/sampling.py: sampling stops at the turn end, and sampled groups equal the repeated prompt rows."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import kiln.posttrain.sampling as sampling
from kiln.model.config import ModelConfig, padded_vocab
from kiln.model.families import build_model
from kiln.model.generate import generate
from kiln.posttrain.sampling import complete, decode_completion
from kiln.posttrain.sft import chat_prompt_ids
from tests.kiln.posttrain.test_chat_template import chatml
from tests.kiln.posttrain.test_logprobs import make


def test_sampling_stops_at_the_turn_end(tiny_tokenizer, monkeypatch):
    import kiln.posttrain.sampling as sampling

    enc = chatml(tiny_tokenizer[0])
    end = enc._special_tokens["<|im_end|>"]
    a = enc.encode_ordinary("a")[0]
    seen = {}

    def fake_generate(model, x, max_new, **kw):  # "a a <|im_end|>", then the stop token repeated, as generate pads
        seen.update(kw)
        return torch.cat([x, torch.tensor([[a, a, end, end, end]] * x.shape[0])], dim=1)

    monkeypatch.setattr(sampling, "generate", fake_generate)
    torch.manual_seed(0)
    m = build_model(ModelConfig(family="llama", vocab_size=padded_vocab(enc.n_vocab), block_size=64, n_layer=1,
                                n_head=2, n_embd=32)).eval()
    out = complete(m, enc, ["hello"], 5, temperature=0.0)[0][0]
    assert seen["stop_token"] == end and out == [a, a, end]
    assert decode_completion(enc, out) == "aa"


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_sampled_groups_equal_the_repeated_prompt_rows(tiny_tokenizer, one_thread, family) -> None:
    """complete() prefills each prompt once and forks its cache; the old path decoded ``samples`` copies of each
    prompt from scratch. Same seed, same tokens, same generator state after."""
    enc, _ = tiny_tokenizer
    model = make(family).eval()
    prompts = ["What is 1 + 2?", "Explain the river.", "What is 10 + 20?", "What is 3 + 4?"]

    def repeated_rows(m, x, n, *, temperature, stop_token, n_vocab, generator, lengths, samples):
        return generate(m, x.repeat_interleave(samples, dim=0), n, temperature=temperature, stop_token=stop_token,
                        n_vocab=n_vocab, generator=generator, lengths=[k for k in lengths for _ in range(samples)])

    g_new, g_old = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    new = complete(model, enc, prompts, max_new_tokens=8, temperature=1.0, samples=6, generator=g_new)
    with mock.patch.object(sampling, "generate", repeated_rows):
        old = complete(model, enc, prompts, max_new_tokens=8, temperature=1.0, samples=6, generator=g_old)
    assert new == old and [len(g) for g in new] == [6] * 4
    assert torch.equal(g_new.get_state(), g_old.get_state())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_prompts_of_different_lengths_decode_in_one_call_as_each_would_alone(tiny_tokenizer, one_thread,
                                                                            family) -> None:
    """Greedy answers of prompts of four lengths, batched in one generate call (shortest first, each fed the rest of
    its prompt a token a step), equal each prompt's answer decoded alone, in the prompts' order."""
    enc, _ = tiny_tokenizer
    model = make(family).eval()
    torch.manual_seed(3)
    with torch.no_grad():  # larger random weights: answers that differ from prompt to prompt
        for w in model.parameters():
            w.normal_(0.0, 0.3)
    prompts = ["What is 10 + 20?", "Explain the river.", "What is 1 + 2?", "Say a word about the old stone bridge."]
    assert len({len(chat_prompt_ids(enc, p)) for p in prompts}) == 4
    calls = []

    def counted(*args, **kw):
        calls.append(kw["lengths"])
        return generate(*args, **kw)

    with mock.patch.object(sampling, "generate", counted):
        batched = complete(model, enc, prompts, max_new_tokens=7)
    assert len(calls) == 1 and calls[0] == sorted(calls[0])  # one call, shortest prompt first
    alone = [complete(model, enc, [p], max_new_tokens=7)[0] for p in prompts]
    assert batched == alone and all(len(g) == 1 and 1 <= len(g[0]) <= 7 for g in batched)
    assert len(set(map(str, batched))) > 1  # the answers differ: a mix-up of rows would show
