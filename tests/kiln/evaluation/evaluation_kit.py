"""Helpers of the evaluation tests: a byte-level encoding (the enc fixture), tiny and table-driven models, direct
log-probabilities, loglikelihood requests and documents of topic words."""

from __future__ import annotations

import random

import pytest
import tiktoken
import torch
import torch.nn as nn
import torch.nn.functional as F
from lm_eval.api.instance import Instance

from kiln.model.cache import KVCache
from kiln.model.config import ModelConfig
from kiln.model.gpt2.model import GPT

PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
FILL = "the a of and to in on with near under over slowly quietly every old new small bright".split()


@pytest.fixture(scope="module")
def enc() -> tiktoken.Encoding:
    ranks = {bytes([i]): i for i in range(256)}
    return tiktoken.Encoding(name="t", pat_str=PAT, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 256})


def tiny_gpt(block_size: int = 32, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(ModelConfig(vocab_size=320, block_size=block_size, n_layer=2, n_head=2, n_embd=32)).eval()


class TableLM(nn.Module):
    """A fake GPT whose next-token logits depend only on the current token: logits = table[idx]."""

    def __init__(self, table: torch.Tensor, block_size: int = 64):
        super().__init__()
        self.config = ModelConfig(vocab_size=table.shape[1], block_size=block_size, n_layer=1, n_head=1, n_embd=8)
        self.table = nn.Parameter(table.clone(), requires_grad=False)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        if cache is not None:  # nothing to remember: only the position moves on
            cache.advance(idx.size(1))
        return self.table[idx]  # (B, T) -> (B, T, V)


def cycle_lm(text: str = "abcdefg") -> TableLM:
    """Greedy decoding from any letter of ``text`` walks the cycle: after 'a' comes 'b', ... after 'g' 'a'."""
    table = torch.zeros(320, 320)
    for a, b in zip(text, text[1:] + text[0]):
        table[ord(a), ord(b)] = 5.0
    return TableLM(table)


def direct_logprob(model: nn.Module, enc: tiktoken.Encoding, ctx: list[int], cont: list[int]) -> float:
    """Sum of log p(cont | ctx) from one full forward pass (log_softmax over the tokenizer's real ids)."""
    x = torch.tensor([(ctx + cont)[:-1]])  # (1, T)
    with torch.no_grad():
        logp = F.log_softmax(model(x)[0, :, : enc.n_vocab], dim=-1)  # (T, Vr)
    n = len(ctx)
    return float(sum(logp[n - 1 + j, t] for j, t in enumerate(cont)))


def ll_req(ctx: str, cont: str) -> Instance:
    return Instance(request_type="loglikelihood", doc={}, arguments=(ctx, cont), idx=0)


def make_docs(n: int, seed: int = 0) -> list[str]:
    """Documents of 10 sentences mixing filler words with 4 made-up topic words of their own."""
    r = random.Random(seed)
    docs = []
    for _ in range(n):
        topic = ["".join(r.choice("bcdfghklmnprstvz") + r.choice("aeiou") for _ in range(3)) for _ in range(4)]
        words = [[r.choice(topic + FILL) for _ in range(r.randint(6, 14))] for _ in range(10)]
        sents = [" ".join(w).capitalize() + "." for w in words]
        docs.append(" ".join(sents))
    return docs


class NGramLM(nn.Module):
    """A fake GPT that memorised some texts: logit 5 for each token that followed the last n-1 tokens there."""

    def __init__(self, texts: list[list[int]], n: int = 10, block_size: int = 64):
        super().__init__()
        self.config = ModelConfig(vocab_size=320, block_size=block_size, n_layer=1, n_head=1, n_embd=8)
        self.n, self.next = n, {}
        for ids in texts:
            for t in range(len(ids) - 1):
                self.next.setdefault(tuple(ids[max(0, t - n + 2) : t + 1]), set()).add(ids[t + 1])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(*idx.shape, self.config.vocab_size)  # (B, T, V)
        for b, row in enumerate(idx.tolist()):
            for t in range(len(row)):
                for nxt in self.next.get(tuple(row[max(0, t - self.n + 2) : t + 1]), ()):
                    out[b, t, nxt] = 5.0
        return out
