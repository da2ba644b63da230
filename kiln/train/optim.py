"""The optimizer every training stage uses, and its learning-rate schedule.

``make_optimizer(model, OptimConfig(...), device)`` then ``make_scheduler(optimizer, cfg, max_steps)``; only
parameters that require gradients are optimized (LoRA trains its adapters alone).

- ``name: adamw``: AdamW on everything, weight decay on matrices only (not biases, norms).
- ``name: muon``: Muon (momentum, then a Newton-Schulz orthogonalised update) on the 2-D weight matrices inside the
  transformer blocks (gpt2's ``transformer.h.*`` attn/mlp weights, llama's ``model.layers.*`` projections), AdamW on
  the rest (embeddings, the output head, norms, biases), as in the Muon papers and nanochat. The two run as one
  optimizer, MuonAdamW, whose groups each name their kind (AdamW's first, so a scheduler's first lr is AdamW's): a
  checkpoint holds both states and the scheduler drives both. LoRA adapters (``lora_A``, ``lora_B``) stay on AdamW:
  their low-rank shape makes an orthogonalised update a poor fit, so a LoRA run with muon is an AdamW run.
  Muon's arithmetic is torch.optim.Muon's (the quintic's coefficients, 5 bf16 steps, eps, the lr scaling), written
  here because torch has no public function for it and its step cannot split the work across FSDP2 ranks: on plain
  tensors (one process, DDP) a step is torch's Muon step bit for bit. Same-shaped matrices are orthogonalised as one
  stack where Newton-Schulz runs in bf16 (``ns_batches``): on the demo model it ran 1.6-1.8x faster on an AVX-512
  CPU, with the same weights bit for bit there (bench/muon_batches.py). One exception: on a CPU without
  AVX-512 (``ns_dtype``) the Newton-Schulz steps run in fp32, because there bf16 matrix products are emulated and ten
  times slower (the demo model's optimizer step: 7.9 s in bf16, 0.76 s in fp32 on a 2-core AVX2 EPYC, where a
  forward and backward take 0.6 s); fp32 is the more exact of the two. There the wide matrices (a Gram side of 256 at
  least twice as wide, or 512 and up: ``spectral_pays``) take the same polynomial through their Gram matrix's
  eigendecomposition, in fewer products (``spectral_newton_schulz``; the demo's fp32 step 1.08x faster). Under FSDP2
  each parameter is a DTensor sharded on dim 0 and Newton-Schulz needs the whole matrix, so each matrix has one owner
  rank: the ranks send the owner their rows of the update, it orthogonalises the matrix and sends each rank back its
  rows. Each rank orthogonalises about 1/world of the matrices and gets the one-process numbers. A DTensor placed any
  other way (tensor-parallel shards, FSDP2 over them) takes whole_muon_step: every rank gathers the whole update and
  orthogonalises it, as a replicated run does. (torch's Muon on the shards instead sums bf16 partial products across
  ranks, about 3% off the one-process update on a 48 x 16 matrix.) Muon's update is not smooth in the gradient where
  the gradient's singular values are tiny (a fresh llama's o_proj: a 2e-7 change in its gradient moved the bf16 update
  by 3%), so DDP and FSDP runs follow the one-process loss curve closely but not its weights bit for bit.
- muP (``model.mup_base_width`` > 0, kiln.model.mup): AdamW's lr of the blocks' weight matrices (the hidden
  matrices, the ones Muon would take) is lr / m, m = n_embd / mup_base_width, in a group of their own after AdamW's
  other two (so a scheduler's first lr is still the configured one); the tables, the head, norms, biases and LoRA
  adapters keep lr.
  Under ``name: muon`` nothing changes: those matrices are Muon's, and muon_lr stays unscaled because Muon's
  orthogonalised update already has spectral norm ~ lr sqrt(max(1, rows/cols)) (muon_lr's scaling), which is muP's
  condition for hidden layers at any width (Yang, Simon, Bernstein 2023, "A Spectral Condition for Feature
  Learning"); AdamW's share (tables, head, vectors) is unscaled under muP anyway.
- ``schedule: cosine``: linear warmup, cosine decay to ``min_lr_ratio`` at max_steps. ``schedule: wsd``: linear
  warmup, constant, then a linear decay to ``min_lr_ratio`` over the last ``decay_fraction`` of the steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Iterable

import torch
import torch.distributed as dist

from kiln.common.config import ConfigError, Domain, check_domains
from kiln.model import mup
from kiln.model.parallel import is_dtensor
from kiln.plan.memory import avx512_cpu_kernels

BLOCK_MARKERS = (".h.", ".layers.")  # parameter names inside a transformer block, for both families

# What pretraining (the base_model asset) changes from OptimConfig's defaults, which fine-tuning keeps: Muon and
# warmup-stable-decay, chosen by bench/speedrun.py on the demo's tokens (kiln.train.recipe.demo_recipe()). AdamW's
# lr 4e-3 with muon_lr 0.01 reaches nanoGPT's final loss on about a fifth fewer tokens (bench/results/
# nanogpt_recipe_seed7/8, nanogpt_steps_seed9) but RL from the demo models it made was beyond noise on no seed
# (rl_grouped_pairs.md, against 3 of 3 from these rates' models in rl_grouped_pairs_old_rates.md): not the default
PRETRAIN_OPTIM: dict = {"name": "muon", "schedule": "wsd"}


@dataclass
class OptimConfig:
    name: str = "adamw"  # "adamw", or "muon": Muon on the blocks' weight matrices, AdamW on the rest
    lr: Annotated[float, Domain(0, low_open=True)] = 2e-3  # peak learning rate after warmup (AdamW's; Muon's is muon_lr)
    min_lr_ratio: Annotated[float, Domain(0, 1)] = 0.1  # the schedule ends at lr * min_lr_ratio at max_steps
    warmup_steps: Annotated[int, Domain(0)] = 50  # linear warmup from 0 to lr
    schedule: str = "cosine"  # "cosine" decay after warmup, or "wsd": warmup, stable, then linear decay
    decay_fraction: Annotated[float, Domain(0, 1)] = 0.3  # wsd: share of max_steps spent decaying at the end
    weight_decay: Annotated[float, Domain(0)] = 0.1  # decoupled decay on matrices (not on biases, norms)
    beta1: Annotated[float, Domain(0, 1, high_open=True)] = 0.9  # AdamW first-moment decay
    beta2: Annotated[float, Domain(0, 1, high_open=True)] = 0.95  # AdamW second-moment decay
    grad_clip: Annotated[float, Domain(0)] = 1.0  # clip the global gradient norm to this (0 disables)
    muon_lr: Annotated[float, Domain(0, low_open=True)] = 0.02  # muon: peak learning rate of the block matrices (scaled by sqrt(max(1, rows/cols)))
    muon_momentum: Annotated[float, Domain(0, 1, high_open=True)] = 0.95  # muon: momentum (Nesterov)

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"optim.name: {self.name!r} is not an optimizer; choose one of {', '.join(OPTIMIZERS)}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"optim.schedule: {self.schedule!r} is not a schedule; "
                              f"choose one of {', '.join(SCHEDULES)}")
        check_domains(self, "optim")  # every number in its Domain, for a config made in code as from_dict checks it


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


# -- Muon's arithmetic

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic's (a, b, c), from Keller Jordan's Muon, as torch's Muon
NS_STEPS = 5  # Newton-Schulz iterations per update
NS_EPS = 1e-7  # floor of the norm the update is divided by

# A Muon group's settings where it leaves them out: torch.optim.Muon's defaults.
MUON_DEFAULTS: dict[str, Any] = {"lr": 1e-3, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
                                 "ns_coefficients": NS_COEFFICIENTS, "eps": NS_EPS, "ns_steps": NS_STEPS}


def ns_dtype(device: torch.device) -> torch.dtype:
    """The dtype Newton-Schulz runs in on ``device``: bf16 (torch's Muon's) on accelerators and on CPUs with AVX-512,
    fp32 on other CPUs, whose bf16 matrix products are emulated (``avx512_cpu_kernels``)."""
    if device.type != "cpu" or avx512_cpu_kernels():
        return torch.bfloat16
    return torch.float32


def newton_schulz(g: torch.Tensor, coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  steps: int = NS_STEPS, eps: float = NS_EPS, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``g`` (rows, cols) orthogonalised, in ``dtype`` (``ns_dtype(g.device)`` unless given): about U V^T where
    g = U S V^T (a random 64 x 32 matrix's singular values come out between 0.68 and 1.05 in bf16; the tiniest of an
    ill-conditioned one stay lower). A stack (n, rows, cols) of same-shaped matrices is orthogonalised matrix by
    matrix in batched products (``orthogonalise``).

    In that dtype, on the wide orientation (so the Gram matrix is the smaller one), g / max(||g||_F, eps) (every
    singular value at most 1) goes through ``steps`` iterations of x <- a x + (b A + c A^2) x with A = x x^T. The
    coefficients maximise the slope at zero rather than converge, which takes small singular values up fast in few
    steps.
    """
    a, b, c = coefficients
    tall = g.size(-2) > g.size(-1)
    x = g.to(dtype or ns_dtype(g.device))
    x = x.mT if tall else x  # (small, large)
    if x.dim() == 2:
        x = x / x.norm().clamp(min=eps)
        if x.dtype == torch.float32 and spectral_pays(*x.shape):
            out = spectral_newton_schulz(x, coefficients, steps)
            if out is not None:
                return out.mT if tall else out
        for _ in range(steps):
            gram = x @ x.T  # (small, small)
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # each matrix by its own norm
        for _ in range(steps):
            gram = x @ x.mT  # (n, small, small)
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def spectral_pays(small: int, large: int) -> bool:
    """Whether an fp32 (small, large) matrix is orthogonalised faster through its Gram matrix's eigendecomposition
    than by Newton-Schulz's products: a Gram side of 256 at least twice as wide (1.4-2.0x faster), or of 512 and up
    (1.5-2.9x), on a 2-core Xeon held to AVX2 (bench/results/ns_spectral_avx2_run1.md). Squarer or smaller ones stay
    with the products (256 x 256 about even, 128 x 512 1.3x faster by eigh but left to the products, as the rule
    was set before that bench ran)."""
    return small >= 512 or (small >= 256 and large >= 2 * small)


def spectral_newton_schulz(x: torch.Tensor, coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                           steps: int = NS_STEPS) -> torch.Tensor | None:
    """Newton-Schulz's result on ``x`` (small, large), already divided by its norm, evaluated through the Gram
    matrix's eigendecomposition: the same polynomial in exact arithmetic, in two small x small x large products, one
    eigh and one small x small product, where the iteration takes two of the first and one of the last a step (written
    here: torch has no matrix-function routine).

    Every iterate is a polynomial in A = x x^T times x, so with A = U diag(l) U^T the result is
    U diag(p(l)) U^T x, where each step maps an eigenvalue l to l (a + b l + c l^2)^2 and multiplies p by
    (a + b l + c l^2); the scalars run in fp64. None where eigh fails (a non-finite update): the caller iterates."""
    a, b, c = coefficients
    try:
        lam, u = torch.linalg.eigh(x @ x.T)
    except torch.linalg.LinAlgError:
        return None
    lam = lam.double().clamp(min=0)  # a Gram matrix's eigenvalues; rounding can leave tiny ones below 0
    poly = torch.ones_like(lam)
    for _ in range(steps):
        factor = a + b * lam + c * lam * lam
        poly, lam = poly * factor, lam * factor * factor
    return ((u * poly.to(u.dtype)) @ u.T) @ x


# The most one stack of updates takes in Newton-Schulz's dtype (its products make a few more of that size).
NS_BATCH_BYTES = 64 << 20


def ns_batches(params: list[tuple[torch.Tensor, dict]]) -> list[list[tuple[torch.Tensor, dict]]]:
    """The (parameter, group) pairs in the batches Newton-Schulz runs together: where it runs in bf16, matrices of
    one shape, device and Newton-Schulz settings, at most NS_BATCH_BYTES a batch; one at a time where it runs in fp32
    (CPUs without AVX-512), where a stack saved about 8% of its time on the demo's matrices and its last bits differ
    from one at a time's (bench/results/muon_batches_run1.md). (Not one shape up to transposition: a tall matrix
    stacked wide is multiplied from another memory layout than torch's Muon uses, and its bf16 products then
    differ now and then in the last bit.)"""
    batches, same = [], {}
    for p, group in params:
        if ns_dtype(p.device) != torch.bfloat16:
            batches.append([(p, group)])
            continue
        key = (tuple(p.shape), p.device, tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"])
        same.setdefault(key, []).append((p, group))
    for (shape, *_), members in same.items():
        n = max(1, NS_BATCH_BYTES // (2 * shape[0] * shape[1]))
        batches += [members[i:i + n] for i in range(0, len(members), n)]
    return batches


def orthogonalise(updates: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
    """newton_schulz of each update (all of one shape), run as one stack."""
    settings = (group["ns_coefficients"], group["ns_steps"], group["eps"])
    if len(updates) == 1:
        return [newton_schulz(updates[0], *settings)]
    return list(newton_schulz(torch.stack(updates), *settings).unbind(0))


def muon_direction(grad: torch.Tensor, buf: torch.Tensor, group: dict) -> torch.Tensor:
    """Muon's momentum: ``buf`` moves towards ``grad`` (in place) and the update to orthogonalise comes back, the
    Nesterov look-ahead (``grad`` moved towards the new ``buf``) or ``buf`` itself. Elementwise: shards step alone."""
    momentum = group["momentum"]
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if group["nesterov"] else buf


def muon_lr(lr: float, shape: tuple[int, ...]) -> float:
    """The step size of a (rows, cols) matrix: ``lr * sqrt(max(1, rows / cols))``, torch's Muon's default rule."""
    rows, cols = shape[:2]
    return lr * math.sqrt(max(1, rows / cols))


def apply_muon(p: torch.Tensor, ortho: torch.Tensor, group: dict, shape: tuple[int, ...]) -> None:
    """Decoupled weight decay, then the orthogonalised update, on ``p`` in place (a whole matrix of ``shape`` or the
    rows of it a rank holds, with ``ortho`` the same rows)."""
    lr = group["lr"]
    p.mul_(1 - lr * group["weight_decay"])
    p.add_(ortho, alpha=-muon_lr(lr, shape))


def momentum_buffer(state: dict, p: torch.Tensor) -> torch.Tensor:
    """``p``'s momentum (zeros at first), shaped and sharded as its gradient."""
    s = state.setdefault(p, {})
    if "momentum_buffer" not in s:
        s["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
    return s["momentum_buffer"]


def muon_step(params: list[tuple[torch.Tensor, dict]], state: dict) -> None:
    """One Muon step of each (parameter, its group), all with gradients: plain tensors as torch's Muon steps them, in
    the batches of ``ns_batches`` (same-shaped matrices orthogonalised as one stack), FSDP2's DTensors together
    (sharded_muon_step)."""
    sharded, plain = [], []
    for p, group in params:
        if not is_dtensor(p):
            plain.append((p, group))
        elif _fsdp_rows(p):
            sharded.append((p, group))
        else:
            whole_muon_step(p, group, state)
    for batch in ns_batches(plain):
        updates = [muon_direction(p.grad, momentum_buffer(state, p), group) for p, group in batch]
        for (p, group), ortho in zip(batch, orthogonalise(updates, batch[0][1])):
            apply_muon(p, ortho, group, p.shape)
    if sharded:
        sharded_muon_step(sharded, state)


def _fsdp_rows(p: torch.Tensor) -> bool:
    """Whether DTensor ``p`` and its gradient are dim-0 shards over a 1-D mesh (FSDP2 alone: sharded_muon_step)."""
    from torch.distributed.tensor import Shard

    return (p.device_mesh.ndim == 1 and tuple(p.placements) == (Shard(0),)
            and tuple(p.grad.placements) == (Shard(0),))


def whole_muon_step(p: torch.Tensor, group: dict, state: dict) -> None:
    """One Muon step of a DTensor placed any other way (tensor-parallel shards, FSDP2 over them): the momentum steps
    on this rank's piece, every rank gathers the whole update, orthogonalises it and keeps its own piece, as a
    replicated (DDP) run does. Every rank holding the parameter must call this, in the same order."""
    from torch.distributed.tensor import distribute_tensor

    update = muon_direction(p.grad, momentum_buffer(state, p), group)  # a DTensor placed as p
    ortho = newton_schulz(update.full_tensor(), group["ns_coefficients"], group["ns_steps"], group["eps"])
    apply_muon(p, distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None), group, p.shape)


def deal(shapes: list[tuple[int, int]], world: int) -> tuple[list[int], list[int]]:
    """(the matrices' indices by Newton-Schulz cost, costliest first; each matrix's owner rank). Dealt in that order,
    each to the rank with the least cost so far (the lowest on a tie): shapes alone decide, so every rank agrees."""
    cost = [min(s) ** 2 * (2 * max(s) + min(s)) for s in shapes]  # one iteration's multiply-adds
    order = sorted(range(len(shapes)), key=lambda i: -cost[i])
    load, owner = [0] * world, [0] * len(shapes)
    for i in order:
        owner[i] = min(range(world), key=load.__getitem__)
        load[owner[i]] += cost[i]
    return order, owner


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` (r, cols), r <= rows, contiguous with zero rows added to make (rows, cols)."""
    if t.size(0) == rows:
        return t.contiguous()
    return torch.cat([t, t.new_zeros(rows - t.size(0), t.size(1))])


def sharded_muon_step(params: list[tuple[torch.Tensor, dict]], state: dict) -> None:
    """One Muon step of FSDP2's parameters (DTensors sharded on dim 0 of one mesh), each matrix orthogonalised on one
    rank only.

    Each rank steps the momentum of its own rows. For each matrix (the order and owners of ``deal``) every rank sends
    its rows of the update to the owner (one gather), which orthogonalises the whole matrix and sends each rank its
    rows of the result (one scatter) as soon as it has it, so the transfers overlap the next matrix's compute.
    Every rank issues the same collectives in the same order. Shards are torch.chunk's (FSDP2's): ceil(rows / world)
    rows each, the last ones shorter or empty, padded to that size for the transfers.
    """
    from torch.distributed.tensor import Shard

    mesh = params[0][0].device_mesh
    for p, _ in params:
        if p.device_mesh != mesh or tuple(p.placements) != (Shard(0),) or tuple(p.grad.placements) != (Shard(0),):
            raise ValueError(f"MuonAdamW: a {tuple(p.shape)} parameter is a DTensor placed {tuple(p.placements)} on "
                             f"{p.device_mesh}; Muon takes FSDP2's dim-0 shards (Shard(0)) on one mesh")
    pg, me, world = mesh.get_group(), mesh.get_local_rank(), mesh.size()
    shapes = [tuple(p.shape) for p, _ in params]
    order, owner = deal(shapes, world)
    chunk = [-(-rows // world) for rows, _ in shapes]  # rows of every (padded) shard
    updates = [muon_direction(p.grad.to_local(), momentum_buffer(state, p).to_local(), group)  # (my rows, cols)
               for p, group in params]

    sends, parts, gathers = {}, {}, []
    for i in order:
        sends[i] = _pad_rows(updates[i], chunk[i])  # (chunk, cols)
        parts[i] = [torch.empty_like(sends[i]) for _ in range(world)] if owner[i] == me else None
        gathers.append(dist.gather(sends[i], parts[i], group=pg, group_dst=owner[i], async_op=True))
    results, pieces, scatters = {}, {}, []  # pieces: what the owner sends, kept until every transfer is done
    for n, i in enumerate(order):
        group, pieces[i] = params[i][1], None
        if owner[i] == me:
            gathers[n].wait()
            whole = torch.cat(parts[i])[:shapes[i][0]]  # (rows, cols): the one-process update
            ortho = newton_schulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])
            pieces[i] = list(_pad_rows(ortho, chunk[i] * world).split(chunk[i]))  # world x (chunk, cols)
        results[i] = torch.empty(chunk[i], shapes[i][1], dtype=ns_dtype(updates[i].device), device=updates[i].device)
        scatters.append(dist.scatter(results[i], pieces[i], group=pg, group_src=owner[i], async_op=True))
    for work in gathers + scatters:
        work.wait()
    for i, (p, group) in enumerate(params):
        local = p.to_local()  # (my rows, cols), p's storage
        apply_muon(local, results[i][:local.size(0)], group, shapes[i])


# -- optimizers

class MuonAdamW(torch.optim.Optimizer):
    """AdamW on some parameter groups and Muon on the others, as one optimizer.

    Each group's ``kind`` is "adamw" or "muon", and the settings a group leaves out are its kind's defaults:
    ``adamw`` holds torch.optim.AdamW's keyword arguments, ``muon`` any of MUON_DEFAULTS' keys. AdamW's groups take
    torch.optim.AdamW's own step (fused where asked), with their moments in this optimizer's state; Muon's groups take
    muon_step. ``state_dict`` is the standard one over the groups in order, which torch.distributed.checkpoint maps
    to parameter names: a checkpoint holds AdamW's moments and Muon's momentum and resumes both exactly.
    """

    def __init__(self, params: Iterable[dict], adamw: dict[str, Any] | None = None,
                 muon: dict[str, Any] | None = None) -> None:
        unknown = sorted(set(muon or {}) - set(MUON_DEFAULTS))
        if unknown:
            raise TypeError(f"MuonAdamW: {', '.join(unknown)} not Muon settings; they are {', '.join(MUON_DEFAULTS)}")
        self._adamw = torch.optim.AdamW([torch.empty(0)], **(adamw or {}))  # checks the settings; steps AdamW's groups
        self.kind_defaults = {"adamw": dict(self._adamw.defaults), "muon": {**MUON_DEFAULTS, **(muon or {})}}
        super().__init__(list(params), defaults={})

    def add_param_group(self, param_group: dict) -> None:
        """Add a group of kind "adamw" or "muon" (its ``kind``); the settings it leaves out are its kind's defaults."""
        kind = param_group.get("kind")
        if kind not in self.kind_defaults:
            raise ValueError(f"MuonAdamW: a parameter group's kind is 'adamw' or 'muon', not {kind!r}")
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if kind == "muon" and any(p.dim() != 2 for p in params):
            raise ValueError("MuonAdamW: a 'muon' group holds matrices only, found shapes "
                             f"{sorted({tuple(p.shape) for p in params if p.dim() != 2})}")
        super().add_param_group({**self.kind_defaults[kind], **param_group, "params": params})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._adamw.param_groups = [g for g in self.param_groups if g["kind"] == "adamw"]
        self._adamw.state = self.state
        if self._adamw.param_groups:
            self._adamw.step()
        muon_step([(p, g) for g in self.param_groups if g["kind"] == "muon" for p in g["params"]
                   if p.grad is not None], self.state)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Optimizer.load_state_dict, after checking the group count; keys may be ids or (from
        torch.distributed.checkpoint) parameter names. Saved groups without ``kind`` (older checkpoints' AdamW groups
        then Muon group) take the kinds of this optimizer's groups in the same places."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"optimizer state has {len(groups)} parameter groups where MuonAdamW has "
                             f"{len(self.param_groups)}: it was saved with another optim.name or lora setting; "
                             "resume with the settings it was saved with")
        groups = [{"kind": mine["kind"], **saved} for mine, saved in zip(self.param_groups, groups)]
        super().load_state_dict({**state_dict, "param_groups": groups})


def is_muon_parameter(name: str, p: torch.nn.Parameter) -> bool:
    """A trainable weight matrix inside a transformer block (not an embedding, the head, a norm, a bias, an adapter):
    Muon's matrices, and muP's hidden ones (kiln.model.mup)."""
    return (p.requires_grad and p.dim() == 2 and name.rsplit(".", 1)[-1] == "weight"
            and any(m in f".{name}" for m in BLOCK_MARKERS))


def adamw_groups(named: list[tuple[str, torch.nn.Parameter]], opt: OptimConfig, hidden_lr_scale: float | None = None
                 ) -> list[dict]:
    """AdamW's two groups: matrices with weight decay, the rest (biases, norms) without. With ``hidden_lr_scale`` (a
    muP model's 1/m, kiln.model.mup.hidden_lr_scale) the blocks' matrices (is_muon_parameter) leave the first group
    for a third, at lr x hidden_lr_scale with the same weight decay."""
    hidden = {id(p) for n, p in named if is_muon_parameter(n, p)} if hidden_lr_scale is not None else set()
    groups = [{"params": [p for _, p in named if p.dim() >= 2 and id(p) not in hidden],
               "weight_decay": opt.weight_decay},
              {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]
    if hidden_lr_scale is not None:
        groups.append({"params": [p for _, p in named if id(p) in hidden], "weight_decay": opt.weight_decay,
                       "lr": opt.lr * hidden_lr_scale})
    return groups


def adamw_settings(opt: OptimConfig, device: torch.device) -> dict[str, Any]:
    """torch.optim.AdamW's keyword arguments: fused on CUDA and CPU."""
    return {"lr": opt.lr, "betas": (opt.beta1, opt.beta2), "fused": device.type in ("cuda", "cpu")}


def build_adamw(named: list[tuple[str, torch.nn.Parameter]], opt: OptimConfig, device: torch.device,
                hidden_lr_scale: float | None = None) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (muP's hidden matrices at lr x hidden_lr_scale: adamw_groups)."""
    return torch.optim.AdamW(adamw_groups(named, opt, hidden_lr_scale), **adamw_settings(opt, device))


def build_muon(named: list[tuple[str, torch.nn.Parameter]], opt: OptimConfig, device: torch.device,
               hidden_lr_scale: float | None = None) -> torch.optim.Optimizer:
    """MuonAdamW: Muon on the blocks' weight matrices, AdamW on the rest; plain AdamW when no matrix qualifies
    (a LoRA run, whose adapters stay on AdamW). ``hidden_lr_scale`` (muP) changes nothing here: the matrices it would
    scale are Muon's, whose lr needs no width factor (see the module docstring)."""
    muon = [p for n, p in named if is_muon_parameter(n, p)]
    if not muon:
        return build_adamw(named, opt, device, hidden_lr_scale)
    chosen = {id(p) for p in muon}
    rest = [(n, p) for n, p in named if id(p) not in chosen]
    groups = [{**g, "kind": "adamw"} for g in adamw_groups(rest, opt)] + [{"params": muon, "kind": "muon"}]
    return MuonAdamW(groups, adamw=adamw_settings(opt, device),
                     muon={"lr": opt.muon_lr, "weight_decay": opt.weight_decay, "momentum": opt.muon_momentum,
                           "nesterov": True})


OPTIMIZERS: dict[str, Callable[[list[tuple[str, torch.nn.Parameter]], OptimConfig, torch.device, float | None],
                               torch.optim.Optimizer]] = {
    "adamw": build_adamw,
    "muon": build_muon,
}


def make_optimizer(model: torch.nn.Module, opt: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer ``opt.name`` names, over the model's parameters that require gradients; a muP model's
    (``model.config.mup_base_width`` > 0) hidden matrices take AdamW's lr / m (kiln.model.mup)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    cfg = getattr(getattr(model, "module", model), "config", None)  # DDP keeps the model in .module
    hidden_lr_scale = mup.hidden_lr_scale(cfg) if cfg is not None and mup.enabled(cfg) else None
    return OPTIMIZERS[opt.name](named, opt, device, hidden_lr_scale)
