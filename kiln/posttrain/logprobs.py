"""Log-probabilities of responses under a model: per token, per sequence, and for (prompt, response) pairs.

``score_responses(model, enc, prompts, responses, seq_len)`` gives each response's summed log-probability;
DPO's loss, RL's KL penalty and the held-out measures are built on ``token_logps``.
"""

from __future__ import annotations

import torch

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
        out += sequence_logps(model(x), y).tolist()
        counts += (y != IGNORE).sum(-1).tolist()
    return out, counts


def score_responses(model: torch.nn.Module, enc, prompts: list[str], responses: list[str], seq_len: int,
                    batch_size: int = 16, device: torch.device | str = "cpu") -> tuple[list[float], list[int]]:
    """(summed response log-prob, response tokens) for each pair, the prompt given."""
    examples = [encode_example(enc, p, r) for p, r in zip(prompts, responses)]
    return score_examples(model, examples, seq_len, enc.eot_token, batch_size, device)
