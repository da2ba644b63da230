"""How a model of any family (kiln.model.families) is prepared for training on one or many ranks: small ``apply_*`` steps called in a fixed order.

``parallelize(model, "fsdp", activation_checkpointing=True, compile=False, device=...)`` inside a torchrun
worker (kiln.train.loop does this); every step works on CPU with gloo and on CUDA with nccl.

A job's layout is a ``MeshLayout`` (pp x dp_replicate x dp_shard x tp ranks); ``build_mesh`` makes its named
DeviceMesh, whose ``"tp"`` dim feeds kiln.model.tensor_parallel.apply_tp, whose ``"dp_shard"`` dim feeds apply_fsdp
and whose ``"pp"`` dim feeds kiln.model.pipeline_parallel.Pipeline.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Annotated, Any, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from kiln.common.config import ConfigError, Domain
from kiln.model.quant import dequantize

STRATEGIES = ("none", "ddp", "fsdp")
# outermost first: tensor parallelism on the closest ranks (one server's), pipeline stages the farthest apart
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class MeshLayout:
    """How the ranks of a job split the work: a (pp, dp_replicate, dp_shard, tp) device mesh whose sizes multiply
    to the world size. Ranks next to each other (one server's GPUs) form the tensor-parallel groups, which talk most;
    pipeline stages, which pass only activations, are the farthest apart."""

    dp_replicate: Annotated[int, Domain(1)] = 1  # model copies that all-reduce their gradients (DDP; with dp_shard > 1, HSDP)
    dp_shard: Annotated[int, Domain(1, also=(-1,))] = -1  # ranks that shard parameters, gradients and optimizer state (FSDP2); -1: what the others leave
    tp: Annotated[int, Domain(1)] = 1  # ranks that split each layer (tensor + sequence parallelism, kiln.model.tensor_parallel)
    pp: Annotated[int, Domain(1)] = 1  # ranks that each run consecutive blocks (pipeline parallelism, kiln.model.pipeline_parallel)
    ep: Annotated[int, Domain(1)] = 1  # ranks that each hold 1/ep of every mixture-of-experts block's experts (expert parallelism,
    # kiln.model.moe.parallelize.apply_ep); not a mesh dim of its own: the experts are split over the dp_shard ranks (ep = dp_shard)

    def resolve(self, world_size: int, cfg: Any = None, where: str = "parallel") -> "MeshLayout":
        """These sizes with dp_shard filled in for ``world_size`` ranks, checked against the model ``cfg`` (when
        given); a layout that cannot run is a ConfigError naming the field and the legal values."""
        for name in MESH_DIMS:
            value = getattr(self, name)
            if value < 1 and not (name == "dp_shard" and value == -1):
                raise ConfigError(f"{where}.{name}: {value} must be at least 1" +
                                  (" (or -1: the ranks the other sizes leave)" if name == "dp_shard" else ""))
        fixed = self.pp * self.dp_replicate * self.tp
        shard = self.dp_shard if self.dp_shard != -1 else world_size // fixed if world_size % fixed == 0 else 0
        if shard < 1 or fixed * shard != world_size:
            legal = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ConfigError(f"{where}: pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} "
                              f"x tp {self.tp} must multiply to the world size {world_size}; each size must divide it "
                              f"({', '.join(map(str, legal))})")
        if self.ep != 1:
            self.check_ep(shard, cfg, where)
        if cfg is not None:
            from kiln.model.tensor_parallel import check_tp

            check_tp(cfg, self.tp, f"{where}.tp")
            if cfg.n_layer % self.pp:
                legal = [d for d in range(1, cfg.n_layer + 1) if cfg.n_layer % d == 0]
                raise ConfigError(f"{where}.pp: {self.pp} pipeline stages must divide the {cfg.n_layer} layers "
                                  f"(model.n_layer); pp may be {', '.join(map(str, legal))}")
        return MeshLayout(self.dp_replicate, shard, self.tp, self.pp, self.ep)

    def check_ep(self, shard: int, cfg: Any, where: str) -> None:
        """Expert parallelism that cannot run: a ConfigError naming ``where.ep`` and the legal values."""
        if self.ep < 1:
            raise ConfigError(f"{where}.ep: {self.ep} must be at least 1")
        if cfg is not None and cfg.family != "moe":
            raise ConfigError(f"{where}.ep: {self.ep}; expert parallelism splits a mixture of experts, and the "
                              f"{cfg.family} family has none: set ep to 1 (or model.family: moe)")
        if self.dp_replicate > 1:
            raise ConfigError(f"{where}.ep: {self.ep} with dp_replicate {self.dp_replicate}; expert parallelism splits "
                              "the experts over the dp_shard ranks, and the replicas would each need all of them: set "
                              "dp_replicate to 1 (or ep to 1)")
        if self.ep != shard:
            raise ConfigError(f"{where}.ep: {self.ep}; the experts are split over the dp_shard ranks, so ep must equal "
                              f"dp_shard ({shard}): set ep to {shard} or 1")
        if cfg is not None and cfg.n_experts % self.ep:
            legal = [d for d in range(1, cfg.n_experts + 1) if cfg.n_experts % d == 0]
            raise ConfigError(f"{where}.ep: {self.ep} must divide model.n_experts ({cfg.n_experts}); ep may be "
                              f"{', '.join(map(str, legal))}")

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in MESH_DIMS)

    def record(self) -> dict[str, int]:
        """The sizes by name, as runs record them (pp only when there are pipeline stages, as runs before it did)."""
        out = {name: getattr(self, name) for name in MESH_DIMS if name != "pp" or self.pp > 1}
        return {**out, "ep": self.ep} if self.ep > 1 else out

    def describe(self) -> str:
        parts = [f"{name} {getattr(self, name)}" for name in (*MESH_DIMS, "ep") if getattr(self, name) > 1]
        return " x ".join(parts) or "one rank"


def build_mesh(parallel: MeshLayout, device_type: str):
    """The job's DeviceMesh (dims named as MESH_DIMS, every dim kept even at size 1, so ``mesh["tp"]`` and
    ``mesh["dp_replicate", "dp_shard"]`` always exist); ``parallel`` resolved for this world first."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, parallel.resolve(dist.get_world_size()).sizes, mesh_dim_names=MESH_DIMS)


def apply_compile(model: nn.Module, backend: str = "inductor") -> None:
    """Compile each transformer block in place (``nn.Module.compile``): parameter names stay unchanged, and
    identical blocks share one compiled graph, so compile time does not grow with depth."""
    for block in model.blocks:  # every family's transformer blocks, in order
        block.compile(backend=backend)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Keep only each block's input for backward and recompute the rest (non-reentrant torch.utils.checkpoint,
    which replays the saved RNG state so dropout masks match)."""
    model.checkpoint_blocks = True


def apply_fsdp(model: nn.Module, device: torch.device, bf16: bool, mesh=None, ignored: set | None = None) -> None:
    """FSDP2: shard every block, then the root (embeddings, head, final norm), over all ranks (or over ``mesh``,
    the data-parallel dims of the job's mesh; after apply_tp, each tensor-parallel shard is sharded further).
    ``ignored``: parameters FSDP2 leaves as they are (experts already split by expert parallelism).

    Each block is its own all-gather/reduce-scatter unit, so only a block or two is unsharded at a time. With
    ``bf16`` the unsharded parameters are bf16 and gradients are reduced in fp32 (no autocast needed).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = mesh if mesh is not None else init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    blocks = [b for b in model.blocks if any(True for _ in b.parameters())]  # a pipeline stage's own blocks
    for i, block in enumerate(blocks):
        # the last block's parameters are needed again at once by backward: keep them gathered
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1, ignored_params=ignored)
    fully_shard(model, mesh=mesh, mp_policy=mp, ignored_params=ignored)


def apply_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """DDP: replicate the model, all-reduce gradients in buckets during backward. Gradients are views into
    the buckets, so they take no second copy of memory."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=ids, gradient_as_bucket_view=True)


def parallelize(model: nn.Module, strategy: str, activation_checkpointing: bool, compile: bool, device: torch.device,
                bf16: bool = False, compile_backend: str = "inductor", fsdp_mesh=None, ignored: set | None = None
                ) -> nn.Module:
    """Apply the steps in their fixed order and return the module to call in the training loop.

    1. compile: per block, in place, before anything wraps the blocks (names and hooks stay as they are);
    2. activation checkpointing: around each (compiled) block call, so recomputation reruns the fast code;
    3. FSDP2 or DDP last: sharding must see the final blocks, and DDP wraps the whole finished model.
    ``model`` itself stays the one to save and load (FSDP2 shards it in place; DDP wraps it). A tensor-parallel
    model is split first (kiln.model.tensor_parallel.apply_tp) and FSDP2 shards it over ``fsdp_mesh``, the
    data-parallel dim of the job's mesh.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"job.parallelism must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
    if strategy != "none" and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"job.parallelism={strategy!r} needs several ranks: launch with torchrun, or use 'none'")
    if compile:
        apply_compile(model, compile_backend)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if strategy == "fsdp":
        apply_fsdp(model, device, bf16, fsdp_mesh, ignored)
        return model
    if strategy == "ddp":
        return apply_ddp(model, device)
    return model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce / reduce-scatter for micro-batches before the last of an accumulation."""
    if enabled:
        yield
    elif hasattr(model, "no_sync"):  # DDP
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (FSDP2's or tensor parallelism's shards)."""
    if not dist.is_available():  # a torch build without distributed has no DTensor
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_param(p: torch.Tensor) -> torch.Tensor:
    """What a module computes with: a parameter every tensor-parallel rank holds whole but applies to its own tokens
    or heads (a replicated DTensor, kiln.model.tensor_parallel.LocalReplicated) as its local copy, whose gradient is
    marked partial (each rank's share; ``align_grads`` or FSDP2 sums them); any other parameter as it is."""
    if is_dtensor(p) and all(pl.is_replicate() for pl in p.placements):
        from torch.distributed.tensor import Partial

        return p.to_local(grad_placements=[Partial()] * len(p.placements))
    return p


def align_grads(params: Iterable[torch.Tensor]) -> None:
    """Each DTensor gradient in its parameter's placement (partial sums summed, a replicated table's gradient
    sharded as the table is): what the optimizer and the gradient norm expect. FSDP2 does this for what it shards."""
    for p in params:
        if p.grad is not None and is_dtensor(p.grad) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2's sharded parameters, norms) or an NF4 weight (QLoRA) as an ordinary tensor; others unchanged."""
    return t.full_tensor() if hasattr(t, "full_tensor") else dequantize(t)


def param_digest(model: nn.Module) -> str:
    """xxh3-128 of every parameter's full value in name order: ranks holding the same model agree on it.

    Under FSDP2 each parameter is gathered in turn (one parameter's memory at a time), so every rank must call this.
    """
    import xxhash

    h = xxhash.xxh3_128()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(full_value(p.detach()).float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm to ``max_norm`` (0 disables clipping) and return the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
    return float(full_value(norm))


def describe(strategy: str, activation_checkpointing: bool, compile: bool) -> str:
    parts = [strategy if strategy != "none" else "one rank"]
    if activation_checkpointing:
        parts.append("activation checkpointing")
    if compile:
        parts.append("torch.compile")
    return ", ".join(parts)

