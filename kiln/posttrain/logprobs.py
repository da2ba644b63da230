"""Log-probabilities of responses under a model: per token, per sequence, and for (prompt, response) pairs.

``model_token_logps(model, x, y)`` gives log p(y_t) (B, T) through the chunked head (kiln.model.loss.token_logprobs:
no (B, T, V) logits or log-softmax); DPO's loss, RL's and PPO's policy and KL terms and the held-out measures are
built on it. ``score_responses(model, enc, prompts, responses, seq_len)`` gives each response's summed log-probability.
``token_logps(logits, y)`` is the same from logits a caller already has.
"""

from __future__ import annotations

import torch

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


def model_sequence_logps(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Summed log-probability of each row's response tokens under ``model``: (B, T), (B, T) -> (B,)."""
    return model_token_logps(model, x, y).sum(-1)


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
