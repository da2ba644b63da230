"""Tensor parallelism with sequence parallelism (Megatron-LM's layout, on DTensor): ``apply_tp(model, tp_mesh)``.

Each family's parallelize module declares its plan (``Parallelize.tp_plan``: module path -> ParallelStyle, for
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
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


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
    if desc.parallelize.tp_plan is None:
        raise ConfigError(f"{field}: {tp}, but the {desc.name} family has no tensor-parallel plan; use {field}: 1")
    kv = desc.parts.kv_heads(cfg)
    ffn = getattr(cfg, "intermediate_size", 0) or 4 * cfg.n_embd
    for what, n in (("model.n_head", cfg.n_head), ("model.n_kv_head", kv), ("the MLP width", ffn),
                    ("model.vocab_size", cfg.vocab_size)):
        if n % tp:
            legal = [d for d in range(1, min(n, 64) + 1) if cfg.n_head % d == 0 and kv % d == 0 and ffn % d == 0
                     and cfg.vocab_size % d == 0]
            raise ConfigError(f"{field}: {tp} does not divide {what} ({n}); legal values for this model: "
                              f"{', '.join(map(str, legal))}")


def apply_tp(model: nn.Module, tp_mesh) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` by its family's plan and re-tie a tied head; returns it."""
    from torch.distributed.tensor.parallel import parallelize_module

    from kiln.model.families import of

    cfg = model.config
    check_tp(cfg, tp_mesh.size())
    desc = of(cfg)
    parallelize_module(model, tp_mesh, held_plan(model, desc.parallelize.tp_plan(cfg)))
    head, table = (_held(model, path) for path in (desc.parts.head.removesuffix(".weight"), desc.parts.embedding_module))
    if desc.parts.tied(cfg) and head is not None and table is not None:
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


INTERLEAVED = "_kiln_interleaved"  # on a module whose parameters FusedColwiseParallel holds rank-interleaved: (parts, tp)


def interleave(t: torch.Tensor, parts: int, tp: int) -> torch.Tensor:
    """Rows of ``parts`` blocks side by side (q | k | v), each split ``tp`` ways, reordered rank by rank:
    q_0 k_0 v_0 | q_1 k_1 v_1 | ... (rank r's rows are the r-th of tp equal runs)."""
    return t.reshape(parts, tp, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


def deinterleave(t: torch.Tensor, parts: int, tp: int) -> torch.Tensor:
    """The inverse of ``interleave``: rows back in the model's own order (q | k | v)."""
    return t.reshape(tp, parts, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


class FusedColwiseParallel(ParallelStyle):
    """Column parallelism for a Linear whose output is ``parts`` blocks side by side (GPT-2's c_attn: q | k | v):
    each rank holds its 1/tp of every block, so its output is q_r | k_r | v_r and splits into ``parts`` equal chunks
    as the whole output does.

    The parameter is held with its rows rank-interleaved (``interleave``) under a plain Shard(0): rank r's shard
    is one contiguous run, so FSDP2 shards it again as any column-parallel weight, and Muon orthogonalises the
    gathered matrix, a row permutation of the model's own (the same update, permuted). What leaves or enters the
    model in its own order goes through ``canonical_state`` / ``interleaved_state`` (the full checkpoints do).
    torch's _StridedShard describes the same shards in the model's order, but FSDP2 over it gathers the matrix in
    the wrong row order (torch 2.13) and torch.distributed.checkpoint refuses it."""

    def __init__(self, parts: int):
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()

        def partition(name, mod, mesh):
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(
                    distribute_tensor(interleave(p.detach(), self.parts, tp), mesh, [Shard(0)]),
                    requires_grad=p.requires_grad))

        setattr(module, INTERLEAVED, (self.parts, tp))
        return distribute_module(module, device_mesh, partition, _replicated_inputs,
                                 lambda mod, out, mesh: out.to_local())

    def __repr__(self) -> str:
        return f"FusedColwiseParallel(parts={self.parts})"


_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def interleaved_params(model: nn.Module) -> dict[str, tuple[int, int]]:
    """{parameter name as state dicts give it: (parts, tp)} of the parameters FusedColwiseParallel holds
    rank-interleaved; {} for a model not split that way."""
    out = {}
    for name, mod in model.named_modules():
        spec = getattr(mod, INTERLEAVED, None)
        if spec is None:
            continue
        for wrapper in _WRAPPERS:
            name = name.replace(wrapper, "")
        out.update({f"{name}.{p}" if name else p: spec for p, _ in mod.named_parameters(recurse=False)})
    return out


def _reorder(state: dict[str, Any], params: dict[str, tuple[int, int]], fn) -> dict[str, Any]:
    """A copy of a full model state dict ({name: tensor}) or a full optimizer state dict ({"state": {name: {key:
    tensor}}, ...}, as torch.distributed.checkpoint.state_dict gives it unflattened) with each tensor of an
    interleaved parameter's shape passed through ``fn``."""
    def one(t: Any, spec: tuple[int, int], rows: int | None = None) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and (rows is None or t.shape[0] == rows):
            return fn(t, *spec)
        return t

    out = dict(state)
    if isinstance(out.get("state"), dict):  # an optimizer state dict
        inner = dict(out["state"])
        for name, spec in params.items():
            if name in inner:
                entry = inner[name]
                rows = next((v.shape[0] for v in entry.values() if isinstance(v, torch.Tensor) and v.dim() >= 1), None)
                inner[name] = {k: one(v, spec, rows) for k, v in entry.items()}
        out["state"] = inner
        return out
    return {**out, **{name: one(out[name], spec) for name, spec in params.items() if name in out}}


def canonical_state(state: dict[str, Any], params: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """Full (gathered) state of a model with interleaved parameters (``interleaved_params``), in the model's own order."""
    return _reorder(state, params, deinterleave) if params else state


def interleaved_state(state: dict[str, Any], params: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """Full state in the model's own order, ready to load into a model holding ``params`` interleaved."""
    return _reorder(state, params, interleave) if params else state


class LocalReplicated(ParallelStyle):
    """A module every tensor-parallel rank holds whole but applies to its own part of the work: the per-head q/k
    norms to its heads, a mixture of experts (router, experts, shared experts) to its sequence shard. Its
    parameters become replicated DTensors that the module uses through ``kiln.model.parallel.local_param`` (the
    local copy, its gradient this rank's partial sum, summed across ranks after backward); DTensor inputs arrive as
    their local shards and the output stays local (a mixture's output is the sequence shard the residual holds)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # parameters only (distribute_module would make DTensors of the buffers too: a mixture's load counts)
        for mod in module.modules():
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(p.detach(), device_mesh, [Replicate()]),
                                                           requires_grad=p.requires_grad))
        module.register_forward_pre_hook(lambda mod, args: _local_inputs(mod, args, device_mesh))
        return module

    def __repr__(self) -> str:
        return "LocalReplicated()"


def _local_inputs(mod: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(a.to_local() if isinstance(a, DTensor) else a for a in args)


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
