"""The models of an arena: a name shown after the vote, the digest of the weights, and an answer function.

``model_contestant(name, path, model, enc, SamplingConfig(max_new_tokens=60))`` answers a prompt with the KV-cache
sampler (kiln.model.generate), in the chat template when the tokenizer has its markers, greedily at temperature 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Callable

import torch
import torch.nn as nn

from kiln.common.config import Domain
from kiln.common.files import stable_hash
from kiln.model.generate import generate


@dataclass
class SamplingConfig:
    max_new_tokens: Annotated[int, Domain(1)] = 60  # longest answer, in tokens
    temperature: Annotated[float, Domain(0)] = 0.0  # 0 answers greedily (the same answer every time); above 0 samples
    top_k: Annotated[int, Domain(1)] = 50  # with temperature > 0: draw among the k likeliest tokens
    seed: Annotated[int, Domain(0)] = 0  # sampling seed (each prompt draws from its own generator seeded by this and the prompt)

    def key(self) -> str:
        """What an answer depends on besides the model and the prompt (cached answers are kept per key)."""
        return stable_hash([self.max_new_tokens, self.temperature, self.top_k if self.temperature > 0 else 0,
                            self.seed if self.temperature > 0 else 0])[:12]


@dataclass
class Contestant:
    name: str  # the reference the person gave (release folder, checkpoint, models:/NAME/VERSION)
    weights: str  # digest of the weights: the model's identity in votes, caches and the arena id
    path: str  # the folder the model was loaded from
    answer: Callable[[str], str]  # prompt -> answer text


def prompt_ids(enc, prompt: str) -> list[int]:
    """The prompt in the chat template (<|user|> prompt <|assistant|>) when the tokenizer has those markers, else
    the plain text (a base model continues it)."""
    if {"<|user|>", "<|assistant|>"} <= set(enc._special_tokens):
        from kiln.posttrain.sft import chat_prompt_ids

        return chat_prompt_ids(enc, prompt)
    return enc.encode_ordinary(prompt) or [enc.eot_token]


@torch.no_grad()
def answer_text(model: nn.Module, enc, prompt: str, cfg: SamplingConfig) -> str:
    """One answer to ``prompt``, up to the first end-of-text, decoded. The prompt keeps its last tokens so that at
    least half the context window (or max_new_tokens, if less) is left for the answer."""
    block = model.config.block_size
    ids = prompt_ids(enc, prompt)[-max(1, block - min(cfg.max_new_tokens, block // 2)):]
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)  # (1, T)
    g = torch.Generator(device=device).manual_seed(int(stable_hash([cfg.seed, prompt])[:12], 16))
    out = generate(model, x, cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k or None,
                   stop_token=enc.eot_token, n_vocab=enc.n_vocab, generator=g)  # (1, T + new)
    new = out[0, len(ids):].tolist()
    if enc.eot_token in new:
        new = new[: new.index(enc.eot_token)]
    return enc.decode(new).strip()


def model_contestant(name: str, path: str, model: nn.Module, enc, cfg: SamplingConfig) -> Contestant:
    """A contestant answering with ``model``; its identity is the digest of its weights (bundle or checkpoint of
    the same weights are one model)."""
    from kiln.train.checkpoint import weights_digest

    model.eval()
    return Contestant(name=name, weights=weights_digest(model.state_dict())[:16], path=str(path),
                      answer=lambda prompt: answer_text(model, enc, prompt, cfg))
