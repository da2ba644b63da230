"""An encoding that carries a chat template (an imported model's own, here ChatML): SFT examples, prompts, the end of an
answer and sampling follow it; saving and loading keep it, and it is part of the fingerprint."""

from __future__ import annotations

import tiktoken
import torch

from kiln.model.config import ModelConfig, padded_vocab
from kiln.model.families import build_model
from kiln.posttrain.sampling import complete, decode_completion
from kiln.posttrain.sft import chat_prompt_ids, encode_example, turn_end
from kiln.tokens.tokenizer import chat_template, encoding_fingerprint, load_encoding, save_encoding, with_chat_template

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chatml(enc) -> tiktoken.Encoding:
    n = enc.n_vocab
    out = tiktoken.Encoding(f"{enc.name}-chatml", pat_str=enc._pat_str, mergeable_ranks=enc._mergeable_ranks,
                            special_tokens={**enc._special_tokens, "<|im_start|>": n, "<|im_end|>": n + 1})
    return with_chat_template(out, CHATML)


def test_examples_and_prompts_follow_the_template(tiny_tokenizer):
    enc = chatml(tiny_tokenizer[0])
    sp = enc._special_tokens
    p = chat_prompt_ids(enc, "two plus two")
    assert p == [sp["<|im_start|>"], *enc.encode_ordinary("user\ntwo plus two"), sp["<|im_end|>"],
                 *enc.encode_ordinary("\n"), sp["<|im_start|>"], *enc.encode_ordinary("assistant\n")]
    ids, mask = encode_example(enc, "two plus two", "four")
    answer = [t for t, m in zip(ids, mask) if m]
    assert ids[: len(p)] == p and sum(mask[: len(p)]) == 0
    assert answer == [*enc.encode_ordinary("four"), sp["<|im_end|>"], *enc.encode_ordinary("\n")]
    assert turn_end(enc) == sp["<|im_end|>"] and turn_end(tiny_tokenizer[0]) == tiny_tokenizer[0].eot_token


def test_kilns_own_format_is_unchanged_without_a_template(tiny_tokenizer):
    enc = tiny_tokenizer[0]
    sp = enc._special_tokens
    assert chat_template(enc) is None
    ids, mask = encode_example(enc, "q", "a")
    assert ids == [sp["<|user|>"], *enc.encode_ordinary("q"), sp["<|assistant|>"], *enc.encode_ordinary("a"), enc.eot_token]


def test_save_and_load_keep_the_template_in_the_fingerprint(tiny_tokenizer, tmp_path):
    plain = chatml(tiny_tokenizer[0])
    fp = encoding_fingerprint(plain)
    save_encoding(plain, tmp_path / "t.json")
    back = load_encoding(tmp_path / "t.json")
    assert chat_template(back) == CHATML and encoding_fingerprint(back) == fp
    with_chat_template(plain, None)
    assert encoding_fingerprint(plain) != fp


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
