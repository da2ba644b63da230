"""The mixture of experts over ranks: the tensor-parallel plan (llama's, the experts held whole), the balance count's
process groups, and expert parallelism (the experts sharded over the data-shard ranks)."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from kiln.model.config import ModelConfig
from kiln.model.llama.parallelize import tp_plan as llama_tp_plan
from kiln.model.moe.model import sparse_layers


def tp_plan(cfg: ModelConfig) -> dict:
    """Llama's plan for the attention, the tables and the head (QK-norm included); each block's mixture of experts
    is held whole by every tensor-parallel rank and routes that rank's sequence shard (sequence parallelism through
    the experts: no collective inside the mixture, the weights' gradients summed across ranks after backward)."""
    from kiln.model.tensor_parallel import LocalReplicated

    layer = "model.layers.*."
    plan = {k: v for k, v in llama_tp_plan(cfg).items() if not k.startswith(layer + "mlp")}
    return {**plan, layer + "mlp": LocalReplicated()}


def apply_moe(model: nn.Module, dp_group: Any, grad_accum: int, pp_group: Any = None, tp: int = 1) -> None:
    """Count the balance over ``dp_group``'s tokens (every rank holding other tokens: the data-parallel ranks and,
    under sequence parallelism, the tensor-parallel ones) and scale the auxiliary gradients for ``grad_accum``
    micro-batches (the loss of each is divided by it before backward; a pipeline schedule scales the summed
    gradients instead: 1) and for ``tp`` sequence shards, whose router gradients are summed. ``pp_group``: the
    pipeline ranks, whose blocks' loads end_step gathers."""
    for layer in sparse_layers(model):
        layer.dp_group, layer.pp_group = dp_group, pp_group
        layer.aux_scale = 1.0 / (grad_accum * tp)


def apply_ep(model: nn.Module, mesh, dp_ranks: int) -> set[nn.Parameter]:
    """Shard every block's experts on the expert dim over ``mesh``'s first dim (the expert-parallel ranks; a second
    dim, the tensor-parallel ranks, holds them whole: after apply_tp); return the sharded parameters (which FSDP2
    must leave alone). ``dp_ranks``: the ranks the loss is averaged over."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = set()
    for layer in sparse_layers(model):
        ex = layer.experts
        for name in ("gate_up_proj", "down_proj"):
            t = getattr(ex, name).data
            t = t.to_local() if hasattr(t, "to_local") else t  # replicated over the tensor-parallel ranks
            p = nn.Parameter(distribute_tensor(t, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1)))
            setattr(ex, name, p)
            out.add(p)
        ex.ep_group, ex.grad_scale = mesh.get_group(0), 1.0 / dp_ranks
    return out
