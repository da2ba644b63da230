"""A conversation with a model: its chat template applied to every turn, the answer streamed a token at a time with
the KV cache, and the cache kept between turns so each turn prefills only what it adds.

``session = ChatSession(model, enc, template)``; ``for piece in session.reply("Hi"): print(piece, end="")``. The
template is a Hugging Face chat template (Jinja over ``messages``, ``add_generation_prompt``), rendered in Jinja's
sandbox as transformers renders it: Kiln's own (kiln.release.hf.CHAT_TEMPLATE) or an imported model's (a GGUF's
``tokenizer.chat_template``). What a person types is encoded as ordinary text, never as special tokens, so typing
``<|endoftext|>`` cannot end a turn or forge one; the template's own markers are the only special tokens.
"""

from __future__ import annotations

import codecs
import functools
import uuid
from typing import Iterator

import torch
import torch.nn as nn

from kiln.model.cache import KVCache
from kiln.model.generate import next_token

class ChatError(ValueError):
    """A template that does not render, or a conversation that no longer fits the model's context."""


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)


def render_ids(enc, template: str, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` in ``template``: the template's own text may hold special tokens, each message's
    content is ordinary text."""
    from jinja2 import TemplateError

    marks = [f"\x00{uuid.uuid4().hex}\x00" for _ in messages]
    try:
        text = _compiled(template).render(
            messages=[{**m, "content": k} for m, k in zip(messages, marks)], add_generation_prompt=add_generation_prompt,
            bos_token="", eos_token="")
    except TemplateError as e:
        raise ChatError(f"chat template does not render: {e}") from e
    ids: list[int] = []
    for m, k in zip(messages, marks):
        head, sep, text = text.partition(k)
        if not sep:
            raise ChatError("chat template leaves out a message's content; it cannot be used to chat")
        ids += enc.encode(head, allowed_special="all") + enc.encode_ordinary(m["content"])
    return ids + enc.encode(text, allowed_special="all")


def stop_ids(enc) -> set[int]:
    """The ids that end an answer: every special token (the end of text, a template's turn end such as ChatML's
    <|im_end|>, and a marker that would open another turn)."""
    return {enc.eot_token, *enc._special_tokens.values()}


class ChatSession:
    """One conversation: the messages so far and a KV cache holding their tokens."""

    def __init__(self, model: nn.Module, enc, template: str, system: str = "", max_new_tokens: int = 256,
                 temperature: float = 0.0, top_k: int | None = None, seed: int = 0):
        self.model, self.enc, self.template = model.eval(), enc, template
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.max_new_tokens, self.temperature, self.top_k = max_new_tokens, temperature, top_k
        self.generator = torch.Generator().manual_seed(seed)
        self.cache = KVCache.for_model(model, 1)
        self.cached: list[int] = []  # the token ids whose keys and values the cache holds, in order
        self.stops = stop_ids(enc)
        self.n_vocab = enc.n_vocab
        self.last_prefill = 0  # tokens the last turn fed before its first new one (what the cache saved shows here)

    def _feed(self, ids: list[int]) -> torch.Tensor:
        """Run ``ids`` after what the cache holds (reusing the longest common prefix); logits of the last one."""
        keep = 0
        while keep < min(len(ids) - 1, len(self.cached)) and self.cached[keep] == ids[keep]:
            keep += 1
        self.cache.pos, self.cached = keep, ids[:keep]  # later positions are overwritten
        new = ids[keep:]
        self.last_prefill = len(new)
        dev = next(self.model.parameters()).device
        logits = self.model(torch.tensor([new], device=dev), cache=self.cache)[:, -1]  # (1, V)
        self.cached += new
        return logits

    def _step(self, tok: int) -> torch.Tensor:
        """One decoding step: ``tok`` after what the cache holds; logits of the next position."""
        dev = next(self.model.parameters()).device
        logits = self.model(torch.tensor([[tok]], device=dev), cache=self.cache)[:, -1]  # (1, V)
        self.cached.append(tok)
        return logits

    @torch.no_grad()
    def reply(self, text: str) -> Iterator[str]:
        """Add the user's ``text`` and stream the assistant's answer as text pieces (whole characters only); the
        answer joins the conversation when it ends (a turn-end token, or max_new_tokens)."""
        self.messages.append({"role": "user", "content": text})
        ids = render_ids(self.enc, self.template, self.messages)
        limit = self.model.config.block_size
        first = 1 if self.messages[0]["role"] == "system" else 0
        while len(ids) + self.max_new_tokens > limit and len(self.messages) > first + 1:
            del self.messages[first]  # the oldest exchange goes first: its question, then its answer
            while len(self.messages) > first + 1 and self.messages[first]["role"] != "user":
                del self.messages[first]
            ids = render_ids(self.enc, self.template, self.messages)
        if len(ids) + 1 > limit:
            self.messages.pop()
            raise ChatError(f"the message is {len(ids)} tokens with the template; the model reads {limit}")
        budget = min(self.max_new_tokens, limit - len(ids))
        logits = self._feed(ids)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        answer: list[int] = []
        for _ in range(budget):
            logits[:, self.n_vocab:] = float("-inf")
            tok = int(next_token(logits, self.temperature, self.top_k, self.generator)[0])
            if tok in self.stops:
                break
            answer.append(tok)
            piece = decoder.decode(self.enc.decode_single_token_bytes(tok))
            if piece:
                yield piece
            if len(self.cached) >= limit:
                break
            logits = self._step(tok)
        tail = decoder.decode(b"", final=True)
        if tail:
            yield tail
        self.messages.append({"role": "assistant", "content": self.enc.decode(answer)})
