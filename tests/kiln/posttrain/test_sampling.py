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

    def repeated_rows(m, x, n, *, temperature, stop_token, n_vocab, generator, samples):
        return generate(m, x.repeat_interleave(samples, dim=0), n, temperature=temperature, stop_token=stop_token,
                        n_vocab=n_vocab, generator=generator)

    g_new, g_old = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    new = complete(model, enc, prompts, max_new_tokens=8, temperature=1.0, samples=6, generator=g_new)
    with mock.patch.object(sampling, "generate", repeated_rows):
        old = complete(model, enc, prompts, max_new_tokens=8, temperature=1.0, samples=6, generator=g_old)
    assert new == old and [len(g) for g in new] == [6] * 4
    assert torch.equal(g_new.get_state(), g_old.get_state())
