"""Sampling answers from a Kiln model in the chat template: groups of samples per prompt, decoded by kiln.model.generate.

``complete(model, enc, prompts, max_new_tokens, temperature=1.0, samples=8)`` gives completions[prompt][sample]
(token lists); RL draws its groups with it and the held-out measures answer greedily (temperature 0).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from kiln.model.generate import generate
from kiln.posttrain.sft import chat_prompt_ids, turn_end


@torch.no_grad()
def complete(model: nn.Module, enc, prompts: list[str], max_new_tokens: int, temperature: float = 0.0, samples: int = 1,
             generator: torch.Generator | None = None, device: torch.device | str = "cpu") -> list[list[list[int]]]:
    """``samples`` completions per prompt, each a token list ending at (and including) the first end-of-text.

    The prompts go in batches of up to 64 rows (64 // samples prompts), shortest first, each batch one generate call:
    right-padded, every prompt prefilled to the batch's shortest length and fed the rest of its own a token a step
    (kiln.model.generate's ``lengths``), its KV cache forked to its ``samples`` rows (``samples``). Batching by exact
    length instead split RL's 8 prompts of a step into several calls of few rows, each decoding as many steps: the
    same sampling, more decoding steps. Returns completions[prompt][sample].
    """
    ids = [chat_prompt_ids(enc, p)[-(model.config.block_size - max_new_tokens):] for p in prompts]
    end = turn_end(enc)  # the end of text, or the chat template's end of a turn
    out: list[list[list[int]]] = [[] for _ in prompts]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # stable: equal lengths keep the prompts' order
    per_call = max(1, 64 // samples)
    for start in range(0, len(order), per_call):
        group = order[start : start + per_call]
        lens = [len(ids[i]) for i in group]
        x = torch.tensor([ids[i] + [end] * (max(lens) - len(ids[i])) for i in group], device=device)  # (G, L)
        gen = generate(model, x, max_new_tokens, temperature=temperature, stop_token=end, n_vocab=enc.n_vocab,
                       generator=generator, lengths=lens, samples=samples).tolist()  # (G*S, L + steps)
        for k, i in enumerate(group):
            for row in gen[k * samples : (k + 1) * samples]:
                row = row[lens[k] : lens[k] + max_new_tokens]
                out[i].append(row[: row.index(end) + 1] if end in row else row)
    return out


def decode_completion(enc, tokens: list[int]) -> str:
    ends = {enc.eot_token, turn_end(enc)}
    return enc.decode([t for t in tokens if t not in ends])
