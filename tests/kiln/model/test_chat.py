"""kiln.model.chat: a turn streams what greedy generation gives on the rendered conversation; later turns prefill only
what they add; typed special-token text stays ordinary text; the template's turn end stops an answer."""

from __future__ import annotations

import pytest
import torch

from kiln.model.chat import ChatError, ChatSession, render_ids
from kiln.model.config import ModelConfig, padded_vocab
from kiln.model.families import build_model
from kiln.model.generate import generate
from kiln.release.hf import CHAT_TEMPLATE

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    enc, _ = tiny_tokenizer
    torch.manual_seed(0)
    cfg = ModelConfig(family="llama", vocab_size=padded_vocab(enc.n_vocab), block_size=128, n_layer=2, n_head=2,
                      n_embd=32)
    m = build_model(cfg).eval()
    with torch.no_grad():  # a random model that never picks a special token: its answers have text to compare
        m.lm_head.weight[list(enc._special_tokens.values())] = 0.0
    return m


def test_render_keeps_typed_specials_ordinary(tiny_tokenizer):
    enc, _ = tiny_tokenizer
    ids = render_ids(enc, CHAT_TEMPLATE, [{"role": "user", "content": "hi <|endoftext|> there"}])
    sp = enc._special_tokens
    assert ids[0] == sp["<|user|>"] and ids[-1] == sp["<|assistant|>"]
    assert enc.eot_token not in ids  # the typed marker is ordinary text
    assert enc.decode(ids[1:-1]) == "hi <|endoftext|> there"
    two = render_ids(enc, CHAT_TEMPLATE, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                     add_generation_prompt=False)
    assert two == [sp["<|user|>"], *enc.encode_ordinary("a"), sp["<|assistant|>"], *enc.encode_ordinary("b"), enc.eot_token]


def test_a_turn_streams_greedy_generation_and_later_turns_reuse_the_cache(model, tiny_tokenizer):
    enc, _ = tiny_tokenizer
    s = ChatSession(model, enc, CHAT_TEMPLATE, max_new_tokens=12)
    first = "".join(s.reply("the cat"))
    ids = render_ids(enc, CHAT_TEMPLATE, [{"role": "user", "content": "the cat"}])
    want = generate(model, torch.tensor([ids]), 12, temperature=0.0, stop_token=enc.eot_token, n_vocab=enc.n_vocab)
    want = [t for t in want[0, len(ids):].tolist() if t != enc.eot_token]
    assert first == enc.decode(want) and s.last_prefill == len(ids)
    second = "".join(s.reply("and the dog"))
    full = render_ids(enc, CHAT_TEMPLATE, s.messages[:-1])
    assert s.last_prefill < len(full)  # only what the second turn added was fed
    want2 = generate(model, torch.tensor([full]), 12, temperature=0.0, stop_token=enc.eot_token, n_vocab=enc.n_vocab)
    assert second == enc.decode([t for t in want2[0, len(full):].tolist() if t != enc.eot_token])
    assert [m["role"] for m in s.messages] == ["user", "assistant", "user", "assistant"]


def test_turn_end_token_stops_the_answer(tiny_tokenizer):
    from kiln.tokens.tokenizer import train_bpe

    enc = train_bpe(["hello there friend"] * 20, 280)
    import tiktoken

    enc = tiktoken.Encoding("chatml", pat_str=enc._pat_str, mergeable_ranks=enc._mergeable_ranks,
                            special_tokens={**enc._special_tokens, "<|im_start|>": enc.n_vocab, "<|im_end|>": enc.n_vocab + 1})
    torch.manual_seed(1)
    m = build_model(ModelConfig(family="llama", vocab_size=padded_vocab(enc.n_vocab), block_size=64, n_layer=1,
                                n_head=2, n_embd=32)).eval()
    with torch.no_grad():  # make <|im_end|> the most likely token everywhere
        m.lm_head.weight.zero_()
        m.lm_head.weight[enc._special_tokens["<|im_end|>"]] = 1.0
        m.model.norm.weight.fill_(1.0) if hasattr(m, "model") else None
    s = ChatSession(m, enc, CHATML, max_new_tokens=10)
    assert "".join(s.reply("hello")) == "" and s.messages[-1] == {"role": "assistant", "content": ""}


def test_a_message_longer_than_the_context_is_refused(model, tiny_tokenizer):
    enc, _ = tiny_tokenizer
    s = ChatSession(model, enc, CHAT_TEMPLATE, max_new_tokens=4)
    with pytest.raises(ChatError, match=r"the model reads 128"):
        list(s.reply("word " * 400))
    assert s.messages == []
    with pytest.raises(ChatError, match="does not render"):
        render_ids(enc, "{% for m in messages %}{{ m.content ", [{"role": "user", "content": "x"}])


def test_old_turns_drop_out_when_the_conversation_outgrows_the_context(model, tiny_tokenizer):
    enc, _ = tiny_tokenizer
    s = ChatSession(model, enc, CHAT_TEMPLATE, max_new_tokens=30)
    for i in range(6):
        list(s.reply(f"message {i}: a fairly long message about cats and dogs"))
    assert len(s.messages) < 12 and s.messages[0]["content"].startswith("message ") and "message 0" not in s.messages[0]["content"]
    assert s.messages[-2]["content"].startswith("message 5")
