"""An encoding that carries a chat template (an imported model's own, here ChatML): SFT examples, prompts, the end of an
answer and sampling follow it; saving and loading keep it, and it is part of the fingerprint."""

from __future__ import annotations

import tiktoken

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
