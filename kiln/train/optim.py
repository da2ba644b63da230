"""The optimizer every training stage uses, and its learning-rate schedule.

``make_optimizer(model, OptimConfig(...), device)`` then ``make_scheduler(optimizer, cfg, max_steps)``; only
parameters that require gradients are optimized (LoRA trains its adapters alone).

- ``name: adamw``: AdamW on everything, weight decay on matrices only (not biases, norms).
- ``name: muon``: torch.optim.Muon (momentum, then Newton-Schulz orthogonalised updates) on the 2-D weight matrices
  inside the transformer blocks (gpt2's ``transformer.h.*`` attn/mlp weights, llama's ``model.layers.*``
  projections), AdamW on the rest (embeddings, the output head, norms, biases), as in the Muon papers and nanochat.
  The two run as one optimizer object (MuonAdamW, AdamW's groups first so a scheduler's first lr is AdamW's), so a
  checkpoint holds both states and the scheduler drives both groups. LoRA adapters (``lora_A``, ``lora_B``) stay on
  AdamW: their low-rank shape makes an orthogonalised update a poor fit, so a LoRA run with muon is an AdamW run.
  Under FSDP2 each parameter is a DTensor sharded on dim 0. torch's Muon runs on it, but the Newton-Schulz matmuls
  then sum bf16 partial products across ranks and drift from the one-process update (about 3% of its size on a
  48 x 16 matrix) while communicating in every iteration. FullMatrixMuon instead gathers each update matrix whole,
  orthogonalises it on every rank (the compute DDP spends) and keeps this rank's rows: the same numbers as one process.
  Muon's update is not smooth in the gradient where the gradient's singular values are tiny (a fresh llama's
  o_proj: a 2e-7 change in its gradient moved the bf16 update by 3%), so DDP and FSDP runs follow the one-process
  loss curve closely but not its weights bit for bit.
- ``schedule: cosine``: linear warmup, cosine decay to ``min_lr_ratio`` at max_steps. ``schedule: wsd``: linear
  warmup, constant, then a linear decay to ``min_lr_ratio`` over the last ``decay_fraction`` of the steps.
"""

from __future__ import annotations

import math
from collections import ChainMap
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz  # torch's own Muon math, for FullMatrixMuon
from torch.optim.optimizer import _to_scalar

from kiln.common.config import ConfigError

BLOCK_MARKERS = (".h.", ".layers.")  # parameter names inside a transformer block, for both families

# What pretraining (the base_model asset) changes from OptimConfig's defaults, which fine-tuning keeps: Muon and
# warmup-stable-decay, chosen by bench/speedrun.py on the demo's tokens (kiln.train.recipe.demo_recipe()).
PRETRAIN_OPTIM: dict = {"name": "muon", "schedule": "wsd"}


@dataclass
class OptimConfig:
    name: str = "adamw"  # "adamw", or "muon": Muon on the blocks' weight matrices, AdamW on the rest
    lr: float = 2e-3  # peak learning rate after warmup (AdamW's; Muon's is muon_lr)
    min_lr_ratio: float = 0.1  # the schedule ends at lr * min_lr_ratio at max_steps
    warmup_steps: int = 50  # linear warmup from 0 to lr
    schedule: str = "cosine"  # "cosine" decay after warmup, or "wsd": warmup, stable, then linear decay
    decay_fraction: float = 0.3  # wsd: share of max_steps spent decaying at the end
    weight_decay: float = 0.1  # decoupled decay on matrices (not on biases, norms)
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    grad_clip: float = 1.0  # clip the global gradient norm to this (0 disables)
    muon_lr: float = 0.02  # muon: peak learning rate of the block matrices (scaled by sqrt(max(1, rows/cols)))
    muon_momentum: float = 0.95  # muon: momentum (Nesterov)

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"optim.name: {self.name!r} is not an optimizer; choose one of {', '.join(OPTIMIZERS)}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"optim.schedule: {self.schedule!r} is not a schedule; "
                              f"choose one of {', '.join(SCHEDULES)}")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ConfigError(f"optim.decay_fraction: {self.decay_fraction} must be between 0 and 1")


# -- schedules: after warmup, the multiplier of each group's peak lr at ``step``

def cosine_decay(opt: OptimConfig, max_steps: int) -> Callable[[int], float]:
    """Cosine from 1 right after warmup to min_lr_ratio at max_steps, flat after."""
    def f(step: int) -> float:
        progress = min(1.0, (step - opt.warmup_steps) / max(1, max_steps - opt.warmup_steps))
        return opt.min_lr_ratio + (1 - opt.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def stable_then_decay(opt: OptimConfig, max_steps: int) -> Callable[[int], float]:
    """1 until the last decay_fraction of the steps (never before warmup ends), then linear to min_lr_ratio."""
    decay_start = max(opt.warmup_steps, round(max_steps * (1 - opt.decay_fraction)))

    def f(step: int) -> float:
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, max_steps - decay_start))
        return opt.min_lr_ratio + (1.0 - opt.min_lr_ratio) * (1.0 - progress)  # exactly min_lr_ratio at the end
    return f


SCHEDULES: dict[str, Callable[[OptimConfig, int], Callable[[int], float]]] = {
    "cosine": cosine_decay,
    "wsd": stable_then_decay,
}


def lr_lambda(opt: OptimConfig, max_steps: int) -> Callable[[int], float]:
    """The schedule as a multiplier of each group's peak lr: linear warmup, then the named schedule."""
    after = SCHEDULES[opt.schedule](opt, max_steps)

    def f(step: int) -> float:
        if step < opt.warmup_steps:
            return (step + 1) / opt.warmup_steps
        return after(step)

    return f


def make_scheduler(optimizer: torch.optim.Optimizer, opt: OptimConfig, max_steps: int):
    """The lr_lambda schedule as a LambdaLR: step it once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(opt, max_steps))


# -- optimizers

class FullMatrixMuon(torch.optim.Muon):
    """torch.optim.Muon that orthogonalises each sharded (DTensor) update as the whole matrix.

    Plain tensors take torch's own step. With DTensors (FSDP2) each parameter's step is torch's
    ``_single_tensor_muon`` for one tensor: momentum on this rank's shard, the Nesterov update gathered whole,
    Newton-Schulz on the full matrix, this rank's rows kept (no further communication), decay and update on the shard.
    """

    @torch.no_grad()
    def step(self, closure=None):
        if not any(_is_dtensor(p) for g in self.param_groups for p in g["params"]):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    muon_update(p, self.state[p], group)
        return loss


def _is_dtensor(t: torch.Tensor) -> bool:
    if not torch.distributed.is_available():  # a torch build without distributed has no DTensor
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def muon_update(p: torch.Tensor, state: dict, group: dict) -> None:
    """One Muon step of parameter ``p`` (rows, cols), a plain tensor or a DTensor, orthogonalising the full matrix."""
    momentum = group["momentum"]
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
    buf = state["momentum_buffer"]  # (rows, cols), sharded as p
    buf.lerp_(p.grad, 1 - momentum)
    update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
    whole = update.full_tensor() if _is_dtensor(update) else update  # (rows, cols) on every rank
    ortho = _zeropower_via_newtonschulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])
    if _is_dtensor(p):  # this rank's rows of the full result, split locally as p is
        from torch.distributed.tensor import distribute_tensor

        ortho = distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None)
    lr = _to_scalar(group["lr"])
    p.mul_(1 - lr * group["weight_decay"])
    p.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW on some parameters and Muon on the others, as one optimizer.

    ``param_groups`` is the two optimizers' groups in order, AdamW's first (the same dicts, so an LR scheduler sets
    both, and its first lr is AdamW's), and ``state_dict`` is one standard optimizer state dict over that order,
    which is what torch.distributed.checkpoint maps to parameter names: a checkpoint holds AdamW's moments and Muon's
    momentum and resumes both exactly. Written here because torch ships the two optimizers but no way to run them
    as one.
    """

    def __init__(self, adamw: torch.optim.AdamW, muon: torch.optim.Muon):  # noqa: D107 (no Optimizer.__init__:
        self.parts = (adamw, muon)                                       # the parts own the groups and state)
        self.defaults = {}
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}

    @property
    def param_groups(self) -> list[dict]:
        return [g for part in self.parts for g in part.param_groups]

    @property
    def state(self) -> ChainMap:
        return ChainMap(*(part.state for part in self.parts))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError("MuonAdamW: add the group to one of its parts (optimizer.parts) instead")

    def state_dict(self) -> dict[str, Any]:
        state, groups, offset = {}, [], 0
        for part in self.parts:
            sd = part.state_dict()
            state.update({i + offset: s for i, s in sd["state"].items()})
            groups += [{**g, "params": [i + offset for i in g["params"]]} for g in sd["param_groups"]]
            offset += sum(len(g["params"]) for g in part.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Split by group position: the first groups are AdamW's. Keys may be ids or (from
        torch.distributed.checkpoint) parameter names; each part's Optimizer.load_state_dict maps them by order."""
        groups = list(state_dict["param_groups"])
        if len(groups) != len(self.param_groups):
            raise ValueError(f"optimizer state has {len(groups)} parameter groups where MuonAdamW has "
                             f"{len(self.param_groups)}: it was saved with another optim.name or lora setting; "
                             "resume with the settings it was saved with")
        for part in self.parts:
            mine, groups = groups[:len(part.param_groups)], groups[len(part.param_groups):]
            keys = {k for g in mine for k in g["params"]}
            part.load_state_dict({"state": {k: s for k, s in state_dict["state"].items() if k in keys},
                                  "param_groups": mine})

    def __repr__(self) -> str:
        return f"MuonAdamW({', '.join(type(p).__name__ for p in self.parts)})"


def is_muon_parameter(name: str, p: torch.nn.Parameter) -> bool:
    """A trainable weight matrix inside a transformer block (not an embedding, the head, a norm, a bias, an adapter)."""
    return (p.requires_grad and p.dim() == 2 and name.rsplit(".", 1)[-1] == "weight"
            and any(m in f".{name}" for m in BLOCK_MARKERS))


def build_adamw(named: list[tuple[str, torch.nn.Parameter]], opt: OptimConfig, device: torch.device
                ) -> torch.optim.AdamW:
    """AdamW (fused on CUDA and CPU) with decay on matrices only."""
    decay = [p for _, p in named if p.dim() >= 2]
    no_decay = [p for _, p in named if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=opt.lr, betas=(opt.beta1, opt.beta2), fused=device.type in ("cuda", "cpu"),
    )


def build_muon(named: list[tuple[str, torch.nn.Parameter]], opt: OptimConfig, device: torch.device
               ) -> torch.optim.Optimizer:
    """MuonAdamW: Muon on the blocks' weight matrices, AdamW on the rest; plain AdamW when no matrix qualifies
    (a LoRA run, whose adapters stay on AdamW)."""
    muon = [p for n, p in named if is_muon_parameter(n, p)]
    chosen = {id(p) for p in muon}
    adamw = build_adamw([(n, p) for n, p in named if id(p) not in chosen], opt, device)
    if not muon:
        return adamw
    return MuonAdamW(adamw, FullMatrixMuon(muon, lr=opt.muon_lr, weight_decay=opt.weight_decay,
                                           momentum=opt.muon_momentum, nesterov=True))


OPTIMIZERS: dict[str, Callable[[list[tuple[str, torch.nn.Parameter]], OptimConfig, torch.device],
                               torch.optim.Optimizer]] = {
    "adamw": build_adamw,
    "muon": build_muon,
}


def make_optimizer(model: torch.nn.Module, opt: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer ``opt.name`` names, over the model's parameters that require gradients."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return OPTIMIZERS[opt.name](named, opt, device)
