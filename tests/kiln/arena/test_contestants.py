"""Tests for kiln.arena.contestants: the sampling key (what an answer depends on), the prompt in the chat template or as
plain text, answers decoded up to the first end-of-text with the prompt cut to leave room for them, seeded sampling per
prompt, and a contestant named by the digest of its weights. A tiny GPT answers; where the tokens must be known, a
forward hook makes it say a scripted sequence.
"""

from __future__ import annotations

import pytest
import tiktoken
import torch

from kiln.arena.contestants import SamplingConfig, answer_text, model_contestant, prompt_ids
from kiln.model.config import ModelConfig, padded_vocab
from kiln.model.families import build_model
from kiln.posttrain.sft import chat_prompt_ids
from kiln.train.checkpoint import weights_digest

BLOCK = 32


def tiny_model(enc, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=padded_vocab(enc.n_vocab), block_size=BLOCK, n_layer=1, n_head=2, n_embd=16)
    return build_model(cfg).eval()


def scripted(model: torch.nn.Module, tokens: list[int]) -> list[list[int]]:
    """Make ``model`` predict ``tokens`` one per forward call (the last one repeated); returns the inputs it gets."""
    seen: list[list[int]] = []

    def hook(module, args, output):
        seen.append(args[0][0].tolist())
        logits = torch.full_like(output, -1e9)  # (B, T, V)
        logits[:, -1, tokens[min(len(seen), len(tokens)) - 1]] = 0.0
        return logits

    model.register_forward_hook(hook)
    return seen


def plain_encoding(enc) -> tiktoken.Encoding:
    """``enc`` without the chat markers: only <|endoftext|>."""
    return tiktoken.Encoding("plain", pat_str=enc._pat_str, mergeable_ranks=enc._mergeable_ranks,
                             special_tokens={"<|endoftext|>": enc.eot_token})


def test_the_sampling_key_depends_on_top_k_and_seed_only_when_sampling():
    greedy = SamplingConfig(max_new_tokens=60, temperature=0.0, top_k=50, seed=0)
    key = greedy.key()
    assert len(key) == 12 and int(key, 16) >= 0
    assert SamplingConfig(max_new_tokens=60, temperature=0.0, top_k=5, seed=9).key() == key  # greedy ignores both
    assert SamplingConfig(max_new_tokens=61).key() != key
    hot = SamplingConfig(temperature=0.7, top_k=50, seed=0)
    assert len({key, hot.key(), SamplingConfig(temperature=0.7, top_k=5).key(),
                SamplingConfig(temperature=0.7, seed=1).key(), SamplingConfig(temperature=0.8).key()}) == 5


def test_a_prompt_is_in_the_chat_template_when_the_tokenizer_has_its_markers(tiny_tokenizer):
    enc, _ = tiny_tokenizer
    ids = prompt_ids(enc, "the cat sees a dog")
    assert ids == chat_prompt_ids(enc, "the cat sees a dog")
    assert ids[0] == enc._special_tokens["<|user|>"] and ids[-1] == enc._special_tokens["<|assistant|>"]
    assert ids[1:-1] == enc.encode_ordinary("the cat sees a dog")
    plain = plain_encoding(enc)  # a base model's tokenizer: the prompt is plain text for the model to continue
    assert prompt_ids(plain, "the cat sees a dog") == enc.encode_ordinary("the cat sees a dog")
    assert prompt_ids(plain, "") == [enc.eot_token]  # never an empty prompt


def test_an_answer_is_the_decoded_tokens_before_the_first_end_of_text(tiny_tokenizer):
    enc, _ = tiny_tokenizer
    model = tiny_model(enc)
    said = enc.encode_ordinary(" a dog walks to the river ")
    seen = scripted(model, said + [enc.eot_token] + enc.encode_ordinary(" never said"))
    assert answer_text(model, enc, "Who walks?", SamplingConfig(max_new_tokens=20)) == "a dog walks to the river"
    assert seen[0] == prompt_ids(enc, "Who walks?")  # the prefill: the whole short prompt
    assert len(seen) == len(said) + 1  # one call per token up to the end-of-text, nothing after it


def test_an_answer_stops_at_max_new_tokens_and_never_uses_padding_ids(tiny_tokenizer):
    enc, _ = tiny_tokenizer
    model = tiny_model(enc)
    the = enc.encode_ordinary(" the")
    assert len(the) == 1 and padded_vocab(enc.n_vocab) > enc.n_vocab

    def hook(module, args, output):
        logits = torch.full_like(output, -1e9)
        logits[:, -1, enc.n_vocab] = 1.0  # a padding id of the embedding: the likeliest, and never drawn
        logits[:, -1, the[0]] = 0.0
        return logits

    model.register_forward_hook(hook)
    assert answer_text(model, enc, "Say the.", SamplingConfig(max_new_tokens=5)) == "the the the the the"


@pytest.mark.parametrize("max_new_tokens,kept", [(60, BLOCK // 2), (10, BLOCK - 10), (4, BLOCK - 4)])
def test_a_long_prompt_keeps_its_last_tokens_and_leaves_room_for_the_answer(tiny_tokenizer, max_new_tokens, kept):
    enc, _ = tiny_tokenizer
    model = tiny_model(enc)
    seen = scripted(model, [enc.eot_token])
    prompt = " ".join(["the old man walks to the market"] * 10)
    assert len(prompt_ids(enc, prompt)) > BLOCK
    assert answer_text(model, enc, prompt, SamplingConfig(max_new_tokens=max_new_tokens)) == ""
    assert seen == [prompt_ids(enc, prompt)[-kept:]]


def test_sampled_answers_are_seeded_per_prompt_and_greedy_ones_ignore_the_seed(tiny_tokenizer):
    enc, _ = tiny_tokenizer
    model = tiny_model(enc, seed=1)
    hot = SamplingConfig(max_new_tokens=12, temperature=1.0, top_k=100, seed=0)
    first = answer_text(model, enc, "Tell me about the river.", hot)
    assert answer_text(model, enc, "Tell me about the river.", hot) == first  # its own generator: the same draw
    other_seed = answer_text(model, enc, "Tell me about the river.", SamplingConfig(12, 1.0, 100, seed=1))
    assert other_seed != first
    cold = [answer_text(model, enc, "Tell me about the river.", SamplingConfig(12, 0.0, 100, seed=s)) for s in (0, 7)]
    assert cold[0] == cold[1]


def test_a_contestant_is_named_by_its_weights_and_answers_with_its_model(tiny_tokenizer, tmp_path):
    enc, _ = tiny_tokenizer
    model = tiny_model(enc, seed=2).train()
    cfg = SamplingConfig(max_new_tokens=8)
    c = model_contestant("models:/kiln/3", tmp_path / "bundle", model, enc, cfg)
    assert (c.name, c.path) == ("models:/kiln/3", str(tmp_path / "bundle"))
    assert c.weights == weights_digest(model.state_dict())[:16] and len(c.weights) == 16
    assert not model.training  # answers come from the model in eval mode
    assert c.answer("Where is the cat?") == answer_text(model, enc, "Where is the cat?", cfg)
    same = model_contestant("checkpoint", "ckpt", tiny_model(enc, seed=2), enc, cfg)
    other = model_contestant("other", "ckpt", tiny_model(enc, seed=3), enc, cfg)
    assert same.weights == c.weights and other.weights != c.weights
