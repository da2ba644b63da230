"""Sampling answers from a Kiln GPT in the chat template: per-row stopping, groups of samples per prompt.

``complete(model, enc, prompts, max_new_tokens, temperature=1.0, samples=8)`` gives completions[prompt][sample]
(token lists); RL draws its groups with it and the held-out measures answer greedily (temperature 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.model.gpt import GPT
from kiln.posttrain.sft import chat_prompt_ids


@torch.no_grad()
def sample(model: GPT, x: torch.Tensor, max_new_tokens: int, temperature: float, stop_token: int,
           generator: torch.Generator | None = None, n_vocab: int | None = None) -> torch.Tensor:
    """Extend x (B, L) by up to max_new_tokens; a row that emitted ``stop_token`` keeps emitting it, and sampling
    ends once every row has (GPT.generate stops only when all rows stop on the same step). Temperature 0 is greedy.
    Ids from ``n_vocab`` up (the embedding's padding past the tokenizer) are never drawn."""
    done = torch.zeros(x.size(0), dtype=torch.bool, device=x.device)  # (B,)
    for _ in range(max_new_tokens):
        logits = model(x[:, -model.config.block_size :])[:, -1, :]  # (B, V)
        if n_vocab is not None:
            logits[:, n_vocab:] = float("-inf")
        if temperature <= 0:
            nxt = logits.argmax(dim=-1)  # (B,)
        else:
            probs = F.softmax(logits / temperature, dim=-1)  # (B, V)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
        nxt = torch.where(done, torch.full_like(nxt, stop_token), nxt)
        x = torch.cat([x, nxt[:, None]], dim=1)  # (B, L+1)
        done |= nxt == stop_token
        if bool(done.all()):
            break
    return x


@torch.no_grad()
def complete(model: GPT, enc, prompts: list[str], max_new_tokens: int, temperature: float = 0.0, samples: int = 1,
             generator: torch.Generator | None = None, device: torch.device | str = "cpu") -> list[list[list[int]]]:
    """``samples`` completions per prompt, each a token list ending at (and including) the first end-of-text.

    Prompts of the same token length share one batch (the model has no padding mask, so lengths must match).
    Returns completions[prompt][sample].
    """
    ids = [chat_prompt_ids(enc, p)[-(model.config.block_size - max_new_tokens):] for p in prompts]
    out: list[list[list[int]]] = [[] for _ in prompts]
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(ids):
        by_len.setdefault(len(p), []).append(i)
    for length, members in sorted(by_len.items()):
        for start in range(0, len(members), max(1, 64 // samples)):
            group = members[start : start + max(1, 64 // samples)]
            x = torch.tensor([ids[i] for i in group for _ in range(samples)], device=device)  # (G*S, L)
            gen = sample(model, x, max_new_tokens, temperature, enc.eot_token, generator, enc.n_vocab)[:, length:].tolist()
            for k, i in enumerate(group):
                for row in gen[k * samples : (k + 1) * samples]:
                    out[i].append(row[: row.index(enc.eot_token) + 1] if enc.eot_token in row else row)
    return out


def decode_completion(enc, tokens: list[int]) -> str:
    return enc.decode([t for t in tokens if t != enc.eot_token])
