"""The training loop's view of the experts: each optimizer step's expert load, gathered over the ranks, aux_free's
routing bias moved toward balance, and the balance measures the loop logs."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from kiln.model.moe.model import SparseMLP


@torch.no_grad()
def begin_step(layers: list[SparseMLP]) -> None:
    """Before a step's micro-batches: forget what the model's mixtures (``sparse_layers``) counted outside training
    steps (a pipeline schedule's shape-inference and evaluation forwards run in training mode)."""
    for m in layers:
        m.load.zero_()
        m.dropped.zero_()


@torch.no_grad()
def end_step(layers: list[SparseMLP]) -> dict[str, Any] | None:
    """After an optimizer step, for the model's mixtures (``sparse_layers``): the step's global expert load per layer
    (all-reduced over the data-parallel ranks), aux_free's bias moved toward balance, the counts reset. Returns
    {"load": (L, E) tensor, "dropped": slots, "losses": the last micro-batch's auxiliary losses}, or None for a dense
    model."""
    if not layers:
        return None
    load = torch.stack([m.load for m in layers])  # (L, E)
    dropped = torch.stack([m.dropped for m in layers]).sum()
    group = layers[0].dp_group
    if group is not None:
        both = torch.cat([load.flatten(), dropped.view(1)])
        dist.all_reduce(both, group=group)
        load, dropped = both[:-1].view_as(load), both[-1]
    losses: dict[str, float] = {}
    for i, m in enumerate(layers):
        if m.balance == "aux_free":
            m.expert_bias += m.bias_rate * torch.sign(load[i].mean() - load[i])  # under-loaded experts rise
        m.load.zero_()
        m.dropped.zero_()
        for k, v in m.last_losses.items():
            losses[k] = losses.get(k, 0.0) + v / len(layers)
    load, dropped = load.cpu(), float(dropped)
    if layers[0].pp_group is not None:  # pipeline stages: every block's load, in block order, on every rank
        parts: list[Any] = [None] * dist.get_world_size(layers[0].pp_group)
        dist.all_gather_object(parts, ([m.layer for m in layers], load.tolist(), dropped, losses),
                               group=layers[0].pp_group)
        rows = sorted((i, row) for idx, rows_, _, _ in parts for i, row in zip(idx, rows_))
        load = torch.tensor([row for _, row in rows], dtype=torch.float32)
        dropped = sum(p[2] for p in parts)
        keys = {k for p in parts for k in p[3]}
        losses = {k: sum(p[3].get(k, 0.0) for p in parts) / len(parts) for k in keys}
    return {"load": load, "dropped": dropped, "losses": losses}


def load_measures(load: torch.Tensor) -> dict[str, float]:
    """Balance of a (L, E) load: max/mean per layer averaged over layers (1 is perfect), the worst layer's, and the
    routing entropy as a fraction of log E (1 is perfect)."""
    mean = load.mean(-1).clamp_min(1e-9)
    ratio = load.max(-1).values / mean  # (L,)
    p = load / load.sum(-1, keepdim=True).clamp_min(1e-9)
    entropy = -(p * p.clamp_min(1e-12).log()).sum(-1) / math.log(load.shape[-1])  # (L,)
    return {"moe/load_max_over_mean": float(ratio.mean()), "moe/load_max_over_mean_worst": float(ratio.max()),
            "moe/load_entropy": float(entropy.mean())}
