"""Log-probabilities of responses under a model: per token, per sequence, and for (prompt, response) pairs.

``model_token_logps(model, x, y)`` gives log p(y_t) (B, T) through the chunked head (kiln.model.loss.token_logprobs:
no (B, T, V) logits or log-softmax); DPO's loss, RL's and PPO's policy and KL terms and the held-out measures are
built on it. ``model_sequence_logps`` sums each row's, with the rows run in groups of similar length
(``grouped_sequence_logps``). ``score_responses(model, enc, prompts, responses, seq_len)`` gives each response's
summed log-probability. ``token_logps(logits, y)`` is the same from logits a caller already has.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from kiln.model.loss import head_inputs, token_logprobs
from kiln.posttrain.sft import IGNORE, encode_example, pad_rows, to_xy, trim_padding


def token_logps(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """logits (B, T, V), targets y (B, T) -> log p(y) (B, T) in float32, 0 where the target is IGNORE."""
    mask = y != IGNORE  # (B, T)
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    picked = logp.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, T)
    return picked * mask


def sequence_logps(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Summed log-probability of each row's response tokens: (B, T, V), (B, T) -> (B,)."""
    return token_logps(logits, y).sum(-1)


def model_token_logps(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x, y (B, T) -> log p(y) (B, T) float32 under ``model`` (DDP-wrapped or not), 0 where y is IGNORE.

    The model's forward runs up to its head, which is then applied a chunk of tokens at a time with the target's
    log-softmax kept (kiln.model.loss.LinearTokenLogProbs): equal to ``token_logps(model(x), y)`` and its gradient,
    without the (B, T, V) float32 tensors."""
    h, w = head_inputs(model, x)  # (B, T, C), (V, C)
    return token_logprobs(h, w, y)  # (B, T)


# a forward pass's fixed cost, counted in padded tokens, when rows are split into groups of similar length: a split is
# made only where it saves more padded tokens than this
PASS_TOKENS = 1024


def length_groups(lengths: list[int], pass_tokens: int | None = None) -> list[list[int]]:
    """Row indices in groups of similar length, shortest first, each to run as one batch padded to its longest row:
    the split of the rows sorted by length whose padded tokens (rows x longest row, per group) plus ``pass_tokens``
    (None: PASS_TOKENS) per group are fewest (dynamic programming over the sorted order, O(rows^2))."""
    pass_tokens = PASS_TOKENS if pass_tokens is None else pass_tokens
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    best, start = [0.0] + [math.inf] * len(order), [0] * (len(order) + 1)  # best[j]: the first j sorted rows
    for j in range(1, len(order) + 1):
        for i in range(j):
            cost = best[i] + pass_tokens + (j - i) * lengths[order[j - 1]]
            if cost < best[j]:
                best[j], start[j] = cost, i
    groups, j = [], len(order)
    while j:
        groups.append(order[start[j]:j])
        j = start[j]
    return groups[::-1]


def target_lengths(y: torch.Tensor) -> list[int]:
    """Each row's width up to and including its last target, y (B, T) -> B ints (1 for a row without targets)."""
    targets = y != IGNORE  # (B, T)
    last = y.size(1) - targets.flip(1).int().argmax(1)  # (B,)
    return torch.where(targets.any(1), last, torch.ones_like(last)).tolist()


def grouped_sequence_logps(token_logps: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
                           y: torch.Tensor) -> torch.Tensor:
    """Summed log-probability of each row's response tokens, (B, T), (B, T) -> (B,), from ``token_logps(x, y)`` (a
    model's token log-probs, (b, t) -> (b, t)) run on groups of rows of similar length (``length_groups``), each cut
    after its longest row's last target: the model is causal, so what follows a row's last target does not change its
    sum. A batch of preference pairs holds a few long rows among many short ones (the demo's: 22 tokens at the median,
    188 at the 90th percentile), and one batch pads every row to the longest.

    With more than one rank the rows run as one batch: ranks would otherwise make different numbers of forward passes,
    and under DDP (its buffer broadcast) or FSDP (its weight gathers) each pass is a collective."""
    if x.size(0) < 2 or (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return token_logps(x, y).sum(-1)
    lengths = target_lengths(y)
    groups = length_groups(lengths)
    if len(groups) == 1:
        return token_logps(x, y).sum(-1)
    parts, order = [], []
    for g in groups:
        idx, t = torch.tensor(g, device=x.device), lengths[g[-1]]  # sorted: its last row is its longest
        parts.append(token_logps(x[idx, :t], y[idx, :t]).sum(-1))
        order.append(idx)
    return torch.cat(parts)[torch.argsort(torch.cat(order))]


def model_sequence_logps(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Summed log-probability of each row's response tokens under ``model``: (B, T), (B, T) -> (B,), the rows run in
    groups of similar length (grouped_sequence_logps)."""
    return grouped_sequence_logps(lambda a, b: model_token_logps(model, a, b), x, y)


def encode_rows(enc, prompts: list[str], responses: list[str], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (prompt, response) in the chat template as its own row: x (N, T), y (N, T) with IGNORE off the response."""
    tokens, mask = pad_rows((encode_example(enc, p, r) for p, r in zip(prompts, responses)), seq_len, enc.eot_token)
    return trim_padding(*to_xy(tokens, mask))


@torch.no_grad()
def score_examples(model: torch.nn.Module, examples: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int,
                   batch_size: int = 16, device: torch.device | str = "cpu") -> tuple[list[float], list[int]]:
    """(summed log-prob of the masked tokens, their count) for each (ids, mask) example, one row each."""
    out, counts = [], []
    for i in range(0, len(examples), batch_size):
        x, y = trim_padding(*to_xy(*pad_rows(iter(examples[i : i + batch_size]), seq_len, pad_id)))
        x, y = x.to(device), y.to(device)
        out += model_sequence_logps(model, x, y).tolist()
        counts += (y != IGNORE).sum(-1).tolist()
    return out, counts


def score_responses(model: torch.nn.Module, enc, prompts: list[str], responses: list[str], seq_len: int,
                    batch_size: int = 16, device: torch.device | str = "cpu") -> tuple[list[float], list[int]]:
    """(summed response log-prob, response tokens) for each pair, the prompt given."""
    examples = [encode_example(enc, p, r) for p, r in zip(prompts, responses)]
    return score_examples(model, examples, seq_len, enc.eot_token, batch_size, device)
