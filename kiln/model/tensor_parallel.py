"""Tensor parallelism with sequence parallelism (Megatron-LM's layout, on DTensor): ``apply_tp(model, tp_mesh)``.

Each family's model file declares its plan (``Family.tp_plan``: module path -> ParallelStyle, for
``torch.distributed.tensor.parallel.parallelize_module``):

- the token embedding is row-parallel over the vocabulary (each rank holds vocab / tp rows; its output is summed);
- inside a block the residual stream is sequence-parallel: each rank holds (B, T / tp, C) and runs the norms on its
  tokens; attention and MLP gather the sequence, their first projections (q, k, v; gate, up; GPT-2's fused c_attn and
  c_fc) are column-parallel, so each rank computes n_head / tp heads and ffn / tp hidden units, and the last ones
  (o_proj, down_proj; c_proj) are row-parallel and reduce-scatter back to sequence shards;
- the output head is column-parallel over the vocabulary and the loss is vocabulary-parallel
  (kiln.model.loss.VocabParallelLinearCrossEntropy: the fused chunked loss, with the softmax's max, sum and target
  logit all-reduced across the tensor-parallel ranks), so no rank holds a (tokens, vocab) tensor.

A tied head is tied again after sharding: the embedding and the head are both (vocab, C) sharded on dim 0, so one
DTensor serves both. Every parameter ends up a DTensor on ``tp_mesh`` (norms replicated), so the optimizer, gradient
clipping and torch.distributed.checkpoint see one kind of parameter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard


def check_tp(cfg: Any, tp: int, field: str = "parallel.tp") -> None:
    """A config error naming ``field`` unless ``cfg``'s heads, key/value heads, widths and vocabulary split ``tp``
    ways (and the family has a plan)."""
    from kiln.common.config import ConfigError
    from kiln.model.families import of

    if tp < 1:
        raise ConfigError(f"{field}: {tp} must be at least 1")
    if tp == 1:
        return
    desc = of(cfg)
    if desc.tp_plan is None:
        raise ConfigError(f"{field}: {tp}, but the {desc.name} family has no tensor-parallel plan; use {field}: 1")
    kv = desc.kv_heads(cfg)
    ffn = getattr(cfg, "intermediate_size", 0) or 4 * cfg.n_embd
    for what, n in (("model.n_head", cfg.n_head), ("model.n_kv_head", kv), ("the MLP width", ffn),
                    ("model.vocab_size", cfg.vocab_size)):
        if n % tp:
            legal = [d for d in range(1, min(n, 64) + 1) if cfg.n_head % d == 0 and kv % d == 0 and ffn % d == 0
                     and cfg.vocab_size % d == 0]
            raise ConfigError(f"{field}: {tp} does not divide {what} ({n}); legal values for this model: "
                              f"{', '.join(map(str, legal))}")
    if getattr(cfg, "qk_norm", False):
        raise ConfigError(f"{field}: {tp} with model.qk_norm: the per-head q/k norms are not sharded by the "
                          f"tensor-parallel plan; use {field}: 1 for QK-norm models")


def apply_tp(model: nn.Module, tp_mesh) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` by its family's plan and re-tie a tied head; returns it."""
    from torch.distributed.tensor.parallel import parallelize_module

    from kiln.model.families import of

    cfg = model.config
    check_tp(cfg, tp_mesh.size())
    desc = of(cfg)
    parallelize_module(model, tp_mesh, held_plan(model, desc.tp_plan(cfg)))
    head, table = (_held(model, path) for path in (desc.head.removesuffix(".weight"), desc.embedding_module))
    if desc.tied(cfg) and head is not None and table is not None:
        head.weight = table.weight
    return model


def _held(model: nn.Module, path: str) -> nn.Module | None:
    """The submodule at ``path`` when ``model`` holds it (a pipeline stage holds some blocks and tables), else None;
    a block another stage runs (an empty stand-in without parameters or children) is not held."""
    try:
        mod = model.get_submodule(path)
    except AttributeError:
        return None
    if mod is None or not any(True for _ in mod.parameters()) and not any(True for _ in mod.children()):
        return None
    return mod


def held_plan(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """``plan`` with its wildcards (``layers.*.mlp``) expanded over the modules ``model`` holds and the entries for
    modules it does not hold left out: a pipeline stage applies the part of the plan that is its own."""
    from fnmatch import fnmatch

    out: dict[str, ParallelStyle] = {}
    for path, style in plan.items():
        found = [""]
        for atom in path.split("."):
            found = [f"{at}.{name}" if at else name for at in found
                     for name, _ in (model.get_submodule(at) if at else model).named_children() if fnmatch(name, atom)]
        out.update({at: style for at in found if _held(model, at) is not None})
    return out


class FusedColwiseParallel(ParallelStyle):
    """Column parallelism for a Linear whose output is ``parts`` blocks side by side (GPT-2's c_attn: q | k | v):
    each rank holds its 1/tp of every block (torch's _StridedShard placement, the one FSDP2 + TP uses for the same
    layout; torch has no public name for it), so its output is q_r | k_r | v_r and splits into ``parts`` equal
    chunks as the whole output does."""

    def __init__(self, parts: int):
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name, mod, mesh):
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(
                    distribute_tensor(p, mesh, [_StridedShard(0, split_factor=self.parts)]),
                    requires_grad=p.requires_grad))

        return distribute_module(module, device_mesh, partition, _replicated_inputs,
                                 lambda mod, out, mesh: out.to_local())

    def __repr__(self) -> str:
        return f"FusedColwiseParallel(parts={self.parts})"


class Replicated(ParallelStyle):
    """A module whose parameters every tensor-parallel rank holds whole (GPT-2's position table): parameters and
    plain-tensor inputs become replicated DTensors, so its output adds to other replicated DTensors and its
    parameters' gradients are summed across ranks by DTensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=_replicated_inputs)

    def __repr__(self) -> str:
        return "Replicated()"


def _replicated_inputs(mod: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
    """Every tensor input as a replicated DTensor (plain tensors are taken to be the same on every rank)."""
    out = []
    for a in args:
        if isinstance(a, DTensor):
            a = a if a.placements == (Replicate(),) else a.redistribute(placements=[Replicate()])
        elif isinstance(a, torch.Tensor):
            a = DTensor.from_local(a, mesh, [Replicate()], run_check=False)
        out.append(a)
    return tuple(out)
