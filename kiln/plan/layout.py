"""The layout planner: how a GPU cluster splits one training step (data, tensor and pipeline parallelism), chosen by
a cost model of memory per rank, communication per link, the pipeline bubble and compute.

``kiln plan --preset llama3-405b-16k-h100`` prints the choice line by line with the runner-up; in Python:
``plan_layout(cfg, seq_len=8192, global_batch=2048, cluster=ClusterConfig(gpus=16384))``.

Every layout of the cluster's GPUs is enumerated (sizes dp_replicate x dp_shard x tp x pp, virtual pipeline stages,
micro-batch, activation checkpointing, whether FSDP keeps the weights gathered for the step), the illegal ones are
refused with a reason naming the field, each legal one is estimated, those that do not fit in memory are dropped,
and the fastest step wins. The estimate is a model, not a measurement: every assumption is a named constant below.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Iterator

from kiln.common.config import ConfigError, Domain, from_dict
from kiln.model.config import ModelConfig
from kiln.model.families import flops_per_token, of
from kiln.model.loss import CE_CHUNK_BYTES
from kiln.plan.memory import (
    GIB,
    RUNTIME_GIB,
    BatchConfig,
    HardwareConfig,
    ParallelConfig,
    PlanError,
    count_params,
    gpu_peak_tflops,
    model_from_config,
)

# ---------------------------------------------------------------------------------------------------- assumptions

# Bytes per parameter of mixed-precision AdamW training (the ZeRO paper's 2 + 2 + 12): bf16 weights for the matmuls,
# bf16 gradients, and the optimizer's fp32 master weights and two fp32 moments. A run that accumulates gradients in
# fp32 (Llama 3 did) adds 2 B per parameter on the gradients it keeps.
WEIGHT_BYTES = 2  # bf16 weights the matmuls read
GRAD_BYTES = 2  # bf16 gradients
OPTIMIZER_BYTES = 12  # fp32 master weights (4) + AdamW's first and second moments (4 + 4)
ACT_BYTES = 2  # activations are bf16
FSDP_GATHERED_BLOCKS = 2  # blocks FSDP holds unsharded at once: the one computing and the one prefetched

# Compute: time = FLOPs / (peak x efficiency). The efficiency is a calibration, not a measurement: a share of the
# dense BF16 peak the step's kernels sustain when matmuls are large (attention, norms and element-wise kernels run
# below the matmuls), lowered for small matmuls: by tokens per micro-batch and by the width each rank multiplies.
KERNEL_EFFICIENCY = 0.6  # share of peak with large matmuls (H100 BF16 GEMMs of Llama sizes reach ~0.7-0.8 alone)
HALF_EFFICIENCY_TOKENS = 512  # tokens per micro-batch at which the matmuls would run at half that share
HALF_EFFICIENCY_WIDTH = 128  # per-rank hidden width (n_embd / tp) at which they would run at half that share
RECOMPUTE_SHARE = 1 / 3  # a recomputed block costs its forward again: a third of forward + backward (backward = 2x)

# Communication: a ring collective over n ranks moves (n-1)/n of the tensor through each rank's link (all-reduce:
# twice), plus a fixed cost per step of the algorithm (log2 n steps assumed: NCCL's trees and hierarchical rings).
# Ranks are numbered tp fastest, then dp_shard, dp_replicate and pp (kiln.model.parallel.MESH_DIMS, innermost last;
# Llama 3 put data parallelism outermost instead, the same links whenever tp fills a server): a group that fits in
# one server talks over NVLink; one that leaves it goes through the network, where the group's members in one
# server share their NICs (one NIC per GPU): bandwidth = members per server x inter_node_gb_s.
# Links are assumed uncontended: TP, PP and DP traffic of different groups do not slow each other.
# Overlap: tensor-parallel collectives and pipeline sends sit between the matmuls that need them (exposed);
# FSDP/DP collectives run beside the compute (prefetch, bucketed reduction) and are exposed only beyond it, but
# slow the compute they hide behind (OVERLAP_SLOWDOWN).
LINK_EFFICIENCY = 0.8  # share of a link's rate large NCCL collectives and sends achieve (nccl-tests bus bandwidth)
OVERLAP_SLOWDOWN = 0.1  # compute lost per second of hidden communication: NCCL kernels take SMs and memory bandwidth

# ---------------------------------------------------------------------------------------------------- configs

SCHEDULES = ("1f1b", "interleaved_1f1b")
STEP_DIGITS = 3  # significant digits of the step time layouts are ranked by (closer ones tie: less memory wins)
CHECKPOINT_CHOICES = (0, 4, 2, 1)  # checkpoint_every values the search tries: none, a quarter, half, every block


@dataclass
class ClusterConfig:
    """The GPUs a run gets and the links between them."""

    gpu: str = "H100"  # GPU model, as shown in the plan
    gpus: Annotated[int, Domain(1)] = 8  # GPUs in the job
    gpus_per_node: Annotated[int, Domain(1)] = 8  # GPUs per server (tensor parallelism stays inside one)
    memory_gb: Annotated[float, Domain(0, low_open=True)] = 80.0  # memory per GPU in GiB
    peak_tflops: Annotated[float, Domain(0, low_open=True)] = 989.4  # dense BF16 peak per GPU in TFLOP/s (kiln.plan.memory.GPU_PEAK_TFLOPS)
    intra_node_gb_s: Annotated[float, Domain(0, low_open=True)] = 450.0  # GB/s per GPU each way inside a server (H100 SXM NVLink 4: 900 GB/s both ways)
    inter_node_gb_s: Annotated[float, Domain(0, low_open=True)] = 50.0  # GB/s per GPU each way between servers (one 400 Gb/s InfiniBand NIC per GPU)
    latency_us: Annotated[float, Domain(0)] = 10.0  # microseconds per step of a collective algorithm, and per point-to-point send
    headroom: Annotated[float, Domain(0, 1, low_open=True)] = 0.8  # share of GPU memory a plan may fill (the rest: allocator slack, NCCL buffers, spikes)


@dataclass
class ReferenceLayout:
    """A layout to evaluate beside the planner's choice (a published one, say): the Layout fields it fixes; a field
    left unset is chosen as the fastest that fits."""

    dp_replicate: Annotated[int | None, Domain(1, none=True)] = None  # model copies that all-reduce their gradients
    dp_shard: Annotated[int | None, Domain(1, none=True)] = None  # ranks that shard weights, gradients and optimizer state (FSDP)
    tp: Annotated[int | None, Domain(1, none=True)] = None  # ranks that split each block, inside one server
    pp: Annotated[int | None, Domain(1, none=True)] = None  # pipeline stages
    virtual_stages: Annotated[int | None, Domain(1, none=True)] = None  # chunks of blocks per pipeline rank (interleaved 1F1B)
    schedule: str | None = None  # "1f1b" or "interleaved_1f1b"
    micro_batch: Annotated[int | None, Domain(1, none=True)] = None  # sequences per forward pass of a data-parallel replica
    checkpoint_every: Annotated[int | None, Domain(0, none=True)] = None  # every n-th block recomputed in backward (0: none)
    reshard_after_forward: bool | None = None  # FSDP gathers the weights per micro-batch (True) or once per step

    def fields(self) -> dict[str, Any]:
        """The Layout fields this reference fixes."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class LayoutRequest:
    """A preset's ``training_plan.layout`` block: plan the layout of training_plan.hardware's GPUs (count, memory,
    peak) over these links."""

    gpu: str = "H100"  # GPU model, as shown in the plan (memory and peak come from training_plan.hardware)
    intra_node_gb_s: Annotated[float, Domain(0, low_open=True)] = 450.0  # GB/s per GPU each way inside a server (H100 SXM NVLink 4: 900 GB/s both ways)
    inter_node_gb_s: Annotated[float, Domain(0, low_open=True)] = 50.0  # GB/s per GPU each way between servers (one 400 Gb/s InfiniBand NIC per GPU)
    latency_us: Annotated[float, Domain(0)] = 10.0  # microseconds per step of a collective algorithm, and per point-to-point send
    reference: ReferenceLayout = field(default_factory=ReferenceLayout)  # a layout to evaluate beside the choice, e.g. a published one
    reference_name: str = ""  # what the plan calls the reference

    def cluster(self, nproc_per_node: int, nnodes: int, memory_gb: float | None, peak_tflops: float | None,
                headroom: float = 0.8, where: str = "training_plan") -> ClusterConfig:
        """The cluster of ``nproc_per_node x nnodes`` GPUs of this model over these links."""
        if not memory_gb:
            raise ConfigError(f"{where}.hardware.memory_gb: a layout plan needs the GPUs' memory in GiB "
                              f"(80 for an H100 SXM)")
        peak = peak_tflops or gpu_peak_tflops(self.gpu)
        if not peak:
            raise ConfigError(f"{where}.hardware.peak_tflops: {self.gpu!r} is not in kiln.plan.memory.GPU_PEAK_TFLOPS; "
                              "give the dense BF16 peak per GPU")
        return ClusterConfig(self.gpu, nproc_per_node * nnodes, nproc_per_node, float(memory_gb), float(peak),
                             self.intra_node_gb_s, self.inter_node_gb_s, self.latency_us, headroom)


@dataclass(frozen=True)
class Layout:
    """How the ranks split a step: a pp x dp_replicate x dp_shard x tp mesh (kiln.model.parallel.MeshLayout's
    sizes, tp innermost), the pipeline schedule, the micro-batch and activation checkpointing."""

    dp_replicate: int = 1  # model copies that all-reduce their gradients (DDP; with dp_shard > 1, HSDP)
    dp_shard: int = 1  # ranks that shard the optimizer state, and weights and gradients between uses (FSDP)
    tp: int = 1  # ranks that split each block (tensor + sequence parallelism), inside one server
    pp: int = 1  # pipeline stages, each holding a run of consecutive blocks
    virtual_stages: int = 1  # chunks of blocks per pipeline rank (interleaved 1F1B); 1 for plain 1F1B
    schedule: str = "1f1b"  # "1f1b" or "interleaved_1f1b" (Narayanan et al. 2021)
    micro_batch: int = 1  # sequences per forward pass of a data-parallel replica
    checkpoint_every: int = 0  # activation checkpointing: every n-th block keeps only its input and recomputes in backward (1: every block; 0: none)
    reshard_after_forward: bool = True  # FSDP: gather the weights for each micro-batch's forward and backward (True) or once per step, keeping them and the gradients whole until its end (False)
    ep: int = 1  # expert parallelism: each block's routed experts split over this many of the dp_shard ranks (a mixture of experts only), tokens sent to them by all-to-all

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return self.dp_replicate, self.dp_shard, self.tp, self.pp

    def describe(self) -> str:
        parts = [f"{k} {v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("dp_shard", self.dp_shard),
                                          ("dp_replicate", self.dp_replicate), ("ep", self.ep)) if v > 1]
        text = " x ".join(parts) or "one GPU"
        if self.pp > 1:
            text += (f", interleaved 1F1B v {self.virtual_stages}" if self.schedule == "interleaved_1f1b" else ", 1F1B")
        text += f", micro_batch {self.micro_batch}"
        text += {0: "", 1: ", checkpoint every block"}.get(self.checkpoint_every,
                                                            f", checkpoint every {_nth(self.checkpoint_every)} block")
        if self.dp_shard > 1 and not self.reshard_after_forward:
            text += ", weights kept gathered"
        return text


def _nth(n: int) -> str:
    return {2: "2nd", 3: "3rd"}.get(n, f"{n}th")


# ---------------------------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Shape:
    """The numbers of a model the cost model reads (kiln.model.families' counts)."""

    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    head_dim: int
    ffn: int  # MLP hidden width
    vocab: int
    params: int  # every parameter, a tied head once
    layer_params: int  # one block
    first_extra: int  # what only the first pipeline stage holds: the token table (and GPT-2's position table)
    last_extra: int  # what only the last stage holds: the final norm and the head (a tied head's copy included)
    saved_per_token: int  # elements autograd keeps per token per block (kiln.plan.memory.saved_per_token)
    layer_flops: float  # training FLOPs per token per block (6 x matmul weights + attention)
    head_flops: float  # training FLOPs per token of the output head (6 x vocab x n_embd)
    model_flops: float  # training FLOPs per token of the model (kiln.model.families.flops_per_token): MFU's numerator
    expert_params: int = 0  # one block's routed experts (a mixture of experts; 0 for a dense model)
    n_experts: int = 0  # routed experts per block
    top_k: int = 0  # experts each token is sent to
    active_params: int = 0  # parameters one token passes through (params for a dense model)

    @staticmethod
    def of(cfg: ModelConfig, seq_len: int) -> "Shape":
        fam = of(cfg)
        v, c = cfg.vocab_size, cfg.n_embd
        total = count_params(cfg)[0]
        tied_table = v * c if fam.parts.tied(cfg) else 0
        model_flops = flops_per_token(cfg, seq_len)
        head_flops = 6.0 * v * c
        experts, n_experts, top_k = fam.counts.routed(cfg) if fam.counts.routed is not None else (0, 0, 0)
        active = total - cfg.n_layer * (fam.counts.layer_params(cfg) - fam.counts.active_layer_params(cfg)) if experts else total
        return Shape(
            n_layer=cfg.n_layer, n_embd=c, n_head=cfg.n_head, n_kv_head=fam.parts.kv_heads(cfg), head_dim=cfg.head_dim,
            ffn=(cfg.moe_intermediate_size if experts else getattr(cfg, "intermediate_size", 0)) or 4 * c, vocab=v,
            params=total, expert_params=experts, n_experts=n_experts, top_k=top_k, active_params=active,
            layer_params=fam.counts.layer_params(cfg),
            first_extra=fam.counts.embedding_params(cfg) - (0 if tied_table else v * c),
            last_extra=v * c + fam.counts.final_norm_params(cfg),
            saved_per_token=fam.counts.saved_per_token(cfg)[0],
            layer_flops=(model_flops - head_flops) / cfg.n_layer, head_flops=head_flops, model_flops=model_flops,
        )


# ---------------------------------------------------------------------------------------------------- legality


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _join(values) -> str:
    values = list(values)
    return ", ".join(map(str, values)) if values else "none"


def stage_layers(n_layer: int, pp: int, v: int) -> tuple[int, int] | None:
    """(blocks on the first and last pipeline rank, blocks on every other rank), or None when the blocks do not split
    into pp x v equal chunks. Blocks split evenly; failing that, n_layer + 2 splits evenly with the first and last
    chunk one block short, the token table and the head each taking a block's place (Llama 3 405B: 126 blocks on 16
    ranks as 128 slots, 7 blocks on the first and last rank and 8 on the others; with chunks of one slot the
    first rank's first chunk is the table alone)."""
    if pp == 1 and v == 1:
        return n_layer, n_layer
    if n_layer % (pp * v) == 0:
        return n_layer // pp, n_layer // pp
    if (n_layer + 2) % (pp * v) == 0:
        return (n_layer + 2) // pp - 1, (n_layer + 2) // pp
    return None


def _pipeline_splits(n_layer: int) -> list[int]:
    return [n for n in range(1, n_layer + 3) if stage_layers(n_layer, n, 1) is not None]


def refusal(layout: Layout, shape: Shape, seq_len: int, global_batch: int, cluster: ClusterConfig) -> str | None:
    """Why ``layout`` cannot run this model, batch and cluster (naming the field and its legal values), or None.

    Key/value heads split over tp when tp divides them; when tp is a multiple of them, each head is assumed
    replicated on tp / n_kv_head ranks, its projections counted on every rank that holds it (Kiln's own
    tensor-parallel plan, kiln.model.tensor_parallel, needs tp to divide them today)."""
    lay = layout
    for name in ("dp_replicate", "dp_shard", "tp", "pp", "virtual_stages", "micro_batch", "ep"):
        if getattr(lay, name) < 1:
            return f"layout.{name}: {getattr(lay, name)} must be at least 1"
    if lay.ep > 1:
        if not shape.n_experts:
            return f"layout.ep: {lay.ep}; expert parallelism splits a mixture of experts, and this model is dense"
        if lay.dp_shard % lay.ep or shape.n_experts % lay.ep:
            legal = [e for e in _divisors(lay.dp_shard) if shape.n_experts % e == 0]
            return (f"layout.ep: {lay.ep} must divide dp_shard ({lay.dp_shard}; the experts are split over the "
                    f"data-shard ranks) and the {shape.n_experts} experts; legal ep: {_join(legal)}")
    if lay.world != cluster.gpus:
        return (f"layout: dp_replicate {lay.dp_replicate} x dp_shard {lay.dp_shard} x tp {lay.tp} x pp {lay.pp} = "
                f"{lay.world} ranks, not the cluster's {cluster.gpus} GPUs; the sizes must multiply to {cluster.gpus}")
    tp_legal = [t for t in _divisors(cluster.gpus_per_node) if _tp_fits(t, shape) is None]
    if cluster.gpus_per_node % lay.tp:
        return (f"layout.tp: {lay.tp} must divide the {cluster.gpus_per_node} GPUs of a server (tensor parallelism "
                f"stays on NVLink); legal tp: {_join(tp_legal)}")
    why = _tp_fits(lay.tp, shape)
    if why:
        return f"layout.tp: {lay.tp} {why}; legal tp: {_join(tp_legal)}"
    if lay.schedule not in SCHEDULES:
        return f"layout.schedule: {lay.schedule!r}; legal: {', '.join(SCHEDULES)}"
    if lay.schedule == "1f1b" and lay.virtual_stages != 1:
        return f"layout.virtual_stages: {lay.virtual_stages} needs schedule interleaved_1f1b; with 1f1b it is 1"
    if lay.schedule == "interleaved_1f1b" and (lay.pp < 2 or lay.virtual_stages < 2):
        return (f"layout.schedule: interleaved_1f1b needs pp >= 2 and virtual_stages >= 2 (pp {lay.pp}, "
                f"virtual_stages {lay.virtual_stages}); use 1f1b")
    if stage_layers(shape.n_layer, lay.pp, lay.virtual_stages) is None:
        if lay.virtual_stages == 1:
            return (f"layout.pp: {lay.pp} stages do not split model.n_layer ({shape.n_layer}) evenly, nor "
                    f"n_layer + 2 ({shape.n_layer + 2}: the first and last stage one block short); legal pp: "
                    f"{_join(_pipeline_splits(shape.n_layer))}")
        legal = [v for v in range(2, shape.n_layer + 3) if stage_layers(shape.n_layer, lay.pp, v) is not None]
        return (f"layout.virtual_stages: pp {lay.pp} x {lay.virtual_stages} chunks do not split model.n_layer "
                f"({shape.n_layer}) or n_layer + 2 evenly; legal virtual_stages with pp {lay.pp}: {_join(legal)}")
    per_replica, rest = divmod(global_batch, lay.dp)
    if rest:
        return (f"layout.dp_shard: batch.global_batch {global_batch} does not split over dp_replicate x dp_shard = "
                f"{lay.dp} data-parallel replicas; legal dp_replicate x dp_shard: "
                f"{_join(d for d in _divisors(global_batch) if cluster.gpus % d == 0)}")
    legal_mb = [b for b in _divisors(per_replica) if per_replica // b >= lay.pp
                and (lay.schedule != "interleaved_1f1b" or (per_replica // b) % lay.pp == 0)]
    if per_replica % lay.micro_batch:
        return (f"layout.micro_batch: {lay.micro_batch} does not divide the {per_replica} sequences of a replica "
                f"(global_batch {global_batch} / dp {lay.dp}); legal micro_batch: {_join(legal_mb)}")
    m = per_replica // lay.micro_batch
    if m < lay.pp:
        return (f"layout.micro_batch: {lay.micro_batch} leaves {m} micro-batches per step, fewer than the {lay.pp} "
                f"pipeline stages (most stages would idle); legal micro_batch: {_join(legal_mb)}")
    if lay.schedule == "interleaved_1f1b" and m % lay.pp:
        return (f"layout.micro_batch: {lay.micro_batch} leaves {m} micro-batches, not a multiple of pp {lay.pp} "
                f"(the interleaved schedule runs them in rounds of pp, as Megatron-LM); legal micro_batch: "
                f"{_join(legal_mb)}")
    if lay.checkpoint_every < 0:
        return f"layout.checkpoint_every: {lay.checkpoint_every}; 0 (none), 1 (every block) or n (every n-th block)"
    return None


def _tp_fits(tp: int, shape: Shape) -> str | None:
    """Why the model's heads, widths or vocabulary do not split ``tp`` ways, or None."""
    if tp == 1:
        return None
    for what, n in (("model.n_head", shape.n_head), ("the MLP width", shape.ffn), ("model.vocab_size", shape.vocab)):
        if n % tp:
            return f"does not divide {what} ({n})"
    if shape.n_kv_head % tp and tp % shape.n_kv_head:
        return f"neither divides nor is a multiple of model.n_kv_head ({shape.n_kv_head})"
    return None


def check_layout(layout: Layout, shape: Shape, seq_len: int, global_batch: int, cluster: ClusterConfig) -> None:
    """Raise a ConfigError naming the field when ``layout`` cannot run."""
    why = refusal(layout, shape, seq_len, global_batch, cluster)
    if why:
        raise ConfigError(why)


# ---------------------------------------------------------------------------------------------------- the estimate


@dataclass
class Collective:
    """One kind of communication in a step, on one rank."""

    name: str  # what it moves, e.g. "tp all-gather + reduce-scatter"
    group: int  # ranks in the group
    link: str  # "nvlink" or "network"
    gb_s: float  # bandwidth per GPU the model gives it, GB/s
    calls: int  # collectives (or sends) per step on this rank
    gib: float  # data through this rank's link per step, GiB
    seconds: float  # time on the link per step
    exposed_s: float  # of which the step waits for


@dataclass
class Estimate:
    """Every figure the cost model gives one layout."""

    layout: Layout
    fits: bool
    memory_gb: dict[str, float]  # GiB on the fullest rank by part, with "total"
    peak_rank: str  # which pipeline rank that is ("first", "second", "last", or "only")
    memory_by_rank_gb: dict[str, dict[str, float]]  # the same for the first, second and last pipeline rank
    budget_gb: float  # memory the plan may use per GPU
    micro_batches: int  # per data-parallel replica per step
    efficiency: float  # share of peak the compute runs at (KERNEL_EFFICIENCY x size factors)
    compute_s: float  # per step on the slowest stage: forward + backward
    recompute_s: float  # per step: the recomputed forwards
    bubble: float  # pipeline bubble as a share of the busy time: (pp - 1) / (v x m)
    bubble_s: float
    comm: list[Collective]
    comm_exposed_s: float
    step_s: float
    mfu: float
    tokens_per_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def _link(cluster: ClusterConfig, stride: int, size: int) -> tuple[str, float]:
    """(link name, GB/s per GPU achieved) of a group of ``size`` ranks ``stride`` apart."""
    if stride * size <= cluster.gpus_per_node:
        return "nvlink", cluster.intra_node_gb_s * LINK_EFFICIENCY
    members = max(1, min(size, cluster.gpus_per_node // stride))  # of the group in one server, sharing its NICs
    return "network", min(cluster.intra_node_gb_s, members * cluster.inter_node_gb_s) * LINK_EFFICIENCY


def _ring(kind: str, nbytes: float, n: int, gb_s: float, latency_us: float) -> tuple[float, float]:
    """(bytes through each rank's link, seconds) of one ring collective of an ``nbytes`` tensor over ``n`` ranks."""
    if n == 1:
        return 0.0, 0.0
    times = 2 if kind == "all_reduce" else 1  # reduce-scatter then all-gather
    moved = times * (n - 1) / n * nbytes
    return moved, moved / (gb_s * 1e9) + times * math.ceil(math.log2(n)) * latency_us * 1e-6


def _hidden(comm_s: float, compute_s: float) -> float:
    """Seconds a collective running beside ``compute_s`` of compute adds to the step: what exceeds the compute,
    plus the compute it slows while hidden (OVERLAP_SLOWDOWN)."""
    return max(0.0, comm_s - compute_s) + OVERLAP_SLOWDOWN * min(comm_s, compute_s)


def _inflight(lay: Layout, rank: int, m: int) -> float:
    """Chunks of blocks (micro-batch x one virtual stage's blocks) whose activations pipeline rank ``rank`` holds at
    its peak: 1F1B's warm-up forwards pp - rank (rank 0: pp micro-batches); interleaved 1F1B's 2 (pp - rank - 1) +
    (v - 1) pp + 1 chunks (Megatron-LM's warm-up; rank 0 holds 1 + (pp - 1) / (pp v) times 1F1B's, as Korthikanti
    et al. 2022 count); never more than the m x v chunks of the step."""
    if lay.pp == 1:
        return 1
    if lay.schedule == "interleaved_1f1b":
        return min(m * lay.virtual_stages, 2 * (lay.pp - rank - 1) + (lay.virtual_stages - 1) * lay.pp + 1)
    return min(m, lay.pp - rank)


def _layer_flops(s: Shape, tokens: int, ep: int) -> float:
    """A block's training FLOPs per token as the dense-efficiency model should count them: a routed expert multiplies
    only the tokens sent to it (tokens x ep x k / E of a micro-batch), so its matmuls run at the efficiency of that
    many tokens, counted as extra dense-equivalent FLOPs."""
    if not s.n_experts:
        return s.layer_flops
    expert_flops = 6.0 * s.top_k * s.expert_params / s.n_experts  # per token per block
    per_expert = tokens * ep * s.top_k / s.n_experts
    slow = (tokens + HALF_EFFICIENCY_TOKENS) / tokens * per_expert / (per_expert + HALF_EFFICIENCY_TOKENS)
    return s.layer_flops + expert_flops * (1 / slow - 1)


def _all_to_all(cluster: ClusterConfig, s: Shape, lay: Layout, tokens: int, blocks: int, recompute: float,
                m: int) -> Collective:
    """Expert parallelism's traffic: per MoE block and micro-batch, the k copies of each token go to their experts'
    ranks and come back (dispatch + combine) in forward, again in backward and in a recomputed forward. The step
    waits for each (the experts need their tokens), so it is all exposed; an all-to-all is ep - 1 sends."""
    ep, tp = lay.ep, lay.tp
    name, bw = _link(cluster, tp, ep)
    nbytes = tokens / tp * s.top_k * s.n_embd * ACT_BYTES * (ep - 1) / ep
    calls = round(blocks * (4 + 2 * recompute)) * m
    sec = calls * (nbytes / (bw * 1e9) + (ep - 1) * cluster.latency_us * 1e-6)
    return Collective("ep all-to-all dispatch + combine", ep, name, bw, calls, calls * nbytes / GIB, sec, sec)


@dataclass(frozen=True)
class _Step:
    """What each part of one layout's estimate reads: the layout, the model's shape and the step's sizes."""

    lay: Layout
    s: Shape
    m: int  # micro-batches per data-parallel replica per step
    tokens: int  # per micro-batch of a replica
    edge: int  # blocks on the first and the last pipeline rank
    middle: int  # blocks on each other rank
    recompute: float  # share of blocks recomputed
    expert_local: float  # a routed block's expert parameters on one rank: split tp x ep ways
    layer_local: float  # a block's parameters on one rank: split tp ways, replicated key/value heads on each rank
    ranks: dict[str, int]  # the ranks whose memory can peak: the first (most micro-batches in flight), the second
    # (as many, a block more under the n_layer + 2 split) and the last (the head and the loss)

    @classmethod
    def of(cls, lay: Layout, s: Shape, seq_len: int, global_batch: int) -> "_Step":
        tp, pp = lay.tp, lay.pp
        edge, middle = stage_layers(s.n_layer, pp, lay.virtual_stages)  # type: ignore[misc]
        kv_local = max(s.n_kv_head / tp, 1)
        expert_local = s.expert_params / (tp * lay.ep)
        layer_local = ((s.layer_params - s.expert_params) / tp + expert_local
                       + 2 * s.n_embd * s.head_dim * (kv_local - s.n_kv_head / tp))
        ranks = ({"only": 0} if pp == 1 else {"first": 0, "last": 1} if pp == 2 else
                 {"first": 0, "second": 1, "last": pp - 1})
        return cls(lay, s, global_batch // lay.dp // lay.micro_batch, lay.micro_batch * seq_len, edge, middle,
                   1 / lay.checkpoint_every if lay.checkpoint_every else 0.0, expert_local, layer_local, ranks)

    def blocks(self, rank: int) -> int:
        return self.edge if rank in (0, self.lay.pp - 1) else self.middle

    def params(self, rank: int) -> float:
        s, pp = self.s, self.lay.pp
        extra = (s.first_extra if rank == 0 else 0) + (s.last_extra if rank == pp - 1 else 0)
        if pp == 1:
            extra = s.params - s.n_layer * s.layer_params  # a tied head counted once
        return self.blocks(rank) * self.layer_local + extra / self.lay.tp


def _memory(st: _Step, rank: int) -> dict[str, float]:
    """GiB on pipeline rank ``rank`` by part (weights, gradients, optimizer, gathered FSDP units, activations, the
    loss's logits, the runtime), with "total"."""
    lay, s, tp, pp, tokens = st.lay, st.s, st.lay.tp, st.lay.pp, st.tokens
    full_act = tokens * ACT_BYTES * s.saved_per_token / tp  # one block of one micro-batch, sequence-parallel
    kept_act = tokens * ACT_BYTES * s.n_embd / tp  # a checkpointed block keeps its input only
    per_block_act = (1 - st.recompute) * full_act + st.recompute * kept_act
    chunk = max(16, CE_CHUNK_BYTES["cuda"] // (4 * s.vocab // tp))  # tokens per chunk of the fused loss
    p = st.params(rank)
    shard = lay.dp_shard
    experts = st.blocks(rank) * st.expert_local  # sharded by FSDP over the dp_shard / ep ranks holding the same experts
    sharded = (p - experts) / shard + experts / (shard // lay.ep)  # what a rank keeps between uses
    out = {"weights": WEIGHT_BYTES * p, "gradients": GRAD_BYTES * p, "optimizer": OPTIMIZER_BYTES * sharded}
    if shard > 1 and lay.reshard_after_forward:
        out["weights"] = WEIGHT_BYTES * sharded
        out["gradients"] = GRAD_BYTES * sharded
        tables = max(s.first_extra if rank == 0 else 0, s.last_extra if rank == pp - 1 else 0) / tp
        biggest = max(st.layer_local, tables)
        out["gathered"] = (WEIGHT_BYTES + GRAD_BYTES) * (FSDP_GATHERED_BLOCKS * st.layer_local + biggest)
    held = _inflight(lay, rank, st.m) * st.blocks(rank) / lay.virtual_stages  # block-micro-batches kept
    out["activations"] = held * per_block_act + (full_act if st.recompute else 0)  # + the block being recomputed
    if rank == pp - 1:  # the fused head + loss: a chunk of fp32 logits and its bf16 copy, the fp32 hidden grads
        out["logits"] = min(tokens, chunk) * s.vocab / tp * 6 + tokens * s.n_embd / tp * 4
    out = {k: x / GIB for k, x in out.items()}
    out["runtime"] = RUNTIME_GIB["cuda"]
    out["total"] = sum(out.values())
    return out


@dataclass(frozen=True)
class _Compute:
    """One micro-batch's compute on the slowest pipeline stage."""

    efficiency: float  # share of peak the matmuls run at
    slowest: int  # the pipeline rank with the most work
    work_s: float  # forward + backward
    redo_s: float  # the recomputed forwards

    @property
    def micro_batch_s(self) -> float:
        return self.work_s + self.redo_s

    @property
    def forward_s(self) -> float:  # a third of forward + backward
        return self.work_s / 3

    @property
    def backward_s(self) -> float:
        return self.micro_batch_s - self.forward_s


def _compute(st: _Step, cluster: ClusterConfig) -> _Compute:
    """Blocks (+ recomputed forwards) and, on the last stage, the head, at an efficiency that falls with small
    micro-batches and narrow tensor-parallel shards."""
    s, tp, pp, tokens = st.s, st.lay.tp, st.lay.pp, st.tokens
    eff = (KERNEL_EFFICIENCY * tokens / (tokens + HALF_EFFICIENCY_TOKENS)
           * (s.n_embd / tp) / (s.n_embd / tp + HALF_EFFICIENCY_WIDTH))
    flop_s = cluster.peak_tflops * 1e12 * eff
    layer_flops = _layer_flops(s, tokens, st.lay.ep)

    def stage_flops(rank: int) -> tuple[float, float]:  # (forward + backward, recompute) per micro-batch per rank
        head = s.head_flops if rank == pp - 1 else 0.0
        work = tokens * (st.blocks(rank) * layer_flops + head) / tp
        return work, tokens * st.blocks(rank) * layer_flops * st.recompute * RECOMPUTE_SHARE / tp

    slowest = max(st.ranks.values(), key=lambda r: sum(stage_flops(r)))
    work, redo = stage_flops(slowest)
    return _Compute(eff, slowest, work / flop_s, redo / flop_s)


def _model_parallel(st: _Step, cluster: ClusterConfig, c: _Compute) -> list[Collective]:
    """The collectives inside each micro-batch, all of which the step waits for: tensor + sequence parallelism's per
    block, all-gather before and reduce-scatter after attention and the MLP, forward and backward (Korthikanti et
    al. 2022), again in a recomputed forward (the token table's and the head's own, one each per micro-batch, are
    left out); expert parallelism's all-to-all; the pipeline's sends, each chunk's output forward and its input
    gradient back, the slowest boundary setting the pace (one that crosses servers goes through each tp rank's
    own NIC)."""
    lay, s, tp, m, lat = st.lay, st.s, st.lay.tp, st.m, cluster.latency_us
    stage_blocks = st.blocks(c.slowest)
    comm: list[Collective] = []
    if tp > 1:
        name, bw = _link(cluster, 1, tp)
        per_call, sec = _ring("all_gather", st.tokens * s.n_embd * ACT_BYTES, tp, bw, lat)
        calls = round(stage_blocks * (8 + 4 * st.recompute))
        comm.append(Collective("tp all-gather + reduce-scatter", tp, name, bw, calls * m,
                               per_call * calls * m / GIB, sec * calls * m, sec * calls * m))
    if lay.ep > 1:
        comm.append(_all_to_all(cluster, s, lay, st.tokens, stage_blocks, st.recompute, m))
    if lay.pp > 1:
        name, bw = ("nvlink", cluster.intra_node_gb_s) if lay.world <= cluster.gpus_per_node else \
            ("network", min(cluster.intra_node_gb_s, cluster.inter_node_gb_s))
        bw *= LINK_EFFICIENCY
        nbytes = st.tokens * s.n_embd * ACT_BYTES / tp  # sequence-parallel: each tp rank sends its shard
        calls = 2 * lay.virtual_stages * m
        sec = calls * (nbytes / (bw * 1e9) + lat * 1e-6)
        comm.append(Collective("pp send/recv", lay.pp, name, bw, calls, calls * nbytes / GIB, sec, sec))
    return comm


def _data_parallel(st: _Step, cluster: ClusterConfig, c: _Compute) -> tuple[list[Collective], float]:
    """(collectives, exposed seconds per micro-batch) of data parallelism: FSDP over dp_shard (per micro-batch when
    weights are resharded after forward, else once per step behind the first forward and the last backward), then
    an all-reduce of each shard's gradients over dp_replicate, behind what is left of the last backward."""
    lay, tp, lat = st.lay, st.lay.tp, cluster.latency_us
    stage_blocks, p_local = st.blocks(c.slowest), st.params(c.slowest)
    comm: list[Collective] = []
    exposed_per_mb = 0.0
    window = c.backward_s  # the last backward, which the end-of-step reductions hide behind
    if lay.dp_shard > 1:
        name, bw = _link(cluster, tp, lay.dp_shard)
        units = stage_blocks + (1 if c.slowest in (0, lay.pp - 1) else 0)  # FSDP units: each block, the tables or head
        experts_local = stage_blocks * st.expert_local  # gathered over the dp_shard / ep ranks holding them
        moved, sec = _ring("all_gather", WEIGHT_BYTES * (p_local - experts_local), lay.dp_shard, bw, 0)
        if lay.dp_shard // lay.ep > 1 and experts_local:
            more = _ring("all_gather", WEIGHT_BYTES * experts_local, lay.dp_shard // lay.ep, bw, 0)
            moved, sec = moved + more[0], sec + more[1]
        sec += math.ceil(math.log2(lay.dp_shard)) * lat * 1e-6 * units  # one collective per unit
        if lay.reshard_after_forward:  # per micro-batch: gather for forward, again for backward, reduce-scatter
            per_mb = 3 * sec
            exposed_per_mb = _hidden(per_mb, c.micro_batch_s)
            # the first block's gather has nothing to hide behind
            first = _ring("all_gather", WEIGHT_BYTES * st.layer_local, lay.dp_shard, bw, lat)[1]
            comm.append(Collective("fsdp all-gather x2 + reduce-scatter per micro-batch", lay.dp_shard, name, bw,
                                   3 * units * st.m, 3 * moved * st.m / GIB, per_mb * st.m,
                                   exposed_per_mb * st.m + first))
        else:  # once per step: gather before the first forward, reduce-scatter after the last backward
            exposed = _hidden(sec, c.forward_s) + _hidden(sec, window)
            window = max(0.0, window - sec)
            comm.append(Collective("fsdp all-gather + reduce-scatter per step", lay.dp_shard, name, bw, 2 * units,
                                   2 * moved / GIB, 2 * sec, exposed))
    if lay.dp_replicate > 1:
        name, bw = _link(cluster, tp * lay.dp_shard, lay.dp_replicate)
        moved, sec = _ring("all_reduce", GRAD_BYTES * p_local / lay.dp_shard, lay.dp_replicate, bw, lat)
        comm.append(Collective("dp all-reduce per step", lay.dp_replicate, name, bw, 1, moved / GIB, sec,
                               _hidden(sec, window)))
    return comm, exposed_per_mb


def estimate(layout: Layout, shape: Shape, seq_len: int, global_batch: int, cluster: ClusterConfig) -> Estimate:
    """Memory per rank, communication, bubble, step time and MFU of a legal ``layout`` (see refusal): the memory of
    the ranks that can peak (``_memory``), the slowest stage's compute (``_compute``), then the collectives inside a
    micro-batch (``_model_parallel``) and around it (``_data_parallel``)."""
    st = _Step.of(layout, shape, seq_len, global_batch)
    by_rank = {name: _memory(st, r) for name, r in st.ranks.items()}
    peak_rank = max(by_rank, key=lambda k: by_rank[k]["total"])
    budget = cluster.memory_gb * cluster.headroom
    c = _compute(st, cluster)
    dp_comm, exposed_per_mb = _data_parallel(st, cluster, c)
    comm = _model_parallel(st, cluster, c) + dp_comm
    m, pp, v = st.m, layout.pp, layout.virtual_stages
    per_mb_comm = sum(x.seconds for x in comm if x.name.startswith(("tp ", "pp ", "ep "))) / m
    # one micro-batch through the slowest stage, as the pipeline sees it
    t_slot = c.micro_batch_s + per_mb_comm + exposed_per_mb
    bubble_s = (pp - 1) / v * t_slot
    comm_exposed = sum(x.exposed_s for x in comm)
    step = m * c.micro_batch_s + bubble_s + comm_exposed
    return Estimate(
        layout=layout, fits=by_rank[peak_rank]["total"] <= budget, memory_gb=by_rank[peak_rank], peak_rank=peak_rank,
        memory_by_rank_gb=by_rank, budget_gb=budget, micro_batches=m, efficiency=c.efficiency,
        compute_s=m * c.work_s, recompute_s=m * c.redo_s, bubble=(pp - 1) / (v * m), bubble_s=bubble_s, comm=comm,
        comm_exposed_s=comm_exposed, step_s=step,
        mfu=shape.model_flops * global_batch * seq_len / (cluster.gpus * cluster.peak_tflops * 1e12 * step),
        tokens_per_s=global_batch * seq_len / step,
    )


# ---------------------------------------------------------------------------------------------------- the search


def candidates(shape: Shape, global_batch: int, cluster: ClusterConfig,
               checkpoint_choices: tuple[int, ...] = CHECKPOINT_CHOICES) -> Iterator[Layout]:
    """Every layout the search considers: tp dividing a server, pp and virtual stages splitting the world and the
    blocks, each split of the data-parallel ranks into replicas x shards, each micro-batch dividing a replica's
    sequences, each checkpointing choice, FSDP's two ways of holding weights, and for a mixture of experts each ep
    dividing the shards and the experts."""
    world = cluster.gpus
    for tp in _divisors(cluster.gpus_per_node):
        if world % tp:
            continue
        for pp in _divisors(world // tp):
            schedules = [("1f1b", 1)]
            if pp > 1:
                schedules += [("interleaved_1f1b", v) for v in range(2, shape.n_layer + 3)
                              if stage_layers(shape.n_layer, pp, v) is not None]
            dp = world // tp // pp
            for schedule, v in schedules:
                for rep in _divisors(dp):
                    shard = dp // rep
                    eps = [e for e in _divisors(shard) if shape.n_experts % e == 0] if shape.n_experts else [1]
                    for mb in _divisors(max(global_batch // dp, 1)):
                        for ckpt in checkpoint_choices:
                            for reshard in ((True, False) if shard > 1 else (True,)):
                                for ep in eps:
                                    yield Layout(rep, shard, tp, pp, v, schedule, mb, ckpt, reshard, ep)


@dataclass
class LayoutPlan:
    """The fastest layout that fits, the runner-up (the fastest that splits the model otherwise: other tp or pp;
    failing that other mesh sizes, or other settings), why, and what was considered."""

    cluster: ClusterConfig
    model: dict  # name, parameters, blocks, width, heads, vocabulary
    seq_len: int
    global_batch: int
    chosen: Estimate
    runner_up: Estimate | None
    why: list[tuple[str, str]]  # (field, sentence): why each size
    considered: dict  # layouts enumerated, refused by field, too big, fitting
    reference: dict | None = None  # {"name", "fields", "relaxed", "estimate" (or None), "fits", "note"}
    max_steps: int = 0  # optimizer steps of the run (0: unknown)
    pinned: dict = field(default_factory=dict)  # Layout fields the config fixed (batch.micro_batch, parallel.*)

    @property
    def hours(self) -> float:
        """Wall-clock hours of max_steps at the chosen step time."""
        return self.chosen.step_s * self.max_steps / 3600

    def to_dict(self) -> dict:
        out = asdict(self)
        out["why"] = [{"field": f, "why": w} for f, w in self.why]
        out["hours"], out["gpu_hours"] = self.hours, self.hours * self.cluster.gpus
        return out


def _matches(lay: Layout, fixed: dict[str, Any]) -> bool:
    return all(getattr(lay, k) == v for k, v in fixed.items())


def search(cfg: ModelConfig, seq_len: int, global_batch: int, cluster: ClusterConfig,
           fixed: dict[str, Any] | None = None, checkpoint_choices: tuple[int, ...] = CHECKPOINT_CHOICES,
           ) -> tuple[list[Estimate], list[Estimate], dict]:
    """(fitting estimates fastest first, legal ones that do not fit, what was considered) over every candidate
    matching ``fixed`` (Layout fields). ``considered``: counts of layouts, refusals by field, too big and fitting,
    and under "refusals" each refused layout with its reason (not serialised)."""
    shape = Shape.of(cfg, seq_len)
    fixed = dict(fixed or {})
    unknown = sorted(set(fixed) - {f.name for f in dataclasses.fields(Layout)})
    if unknown:
        raise ConfigError(f"layout: unknown field '{unknown[0]}'; Layout fields: "
                          f"{', '.join(f.name for f in dataclasses.fields(Layout))}")
    choices = (fixed["checkpoint_every"],) if "checkpoint_every" in fixed else checkpoint_choices
    fitting, too_big, refused, refusals = [], [], {}, []
    seen = 0
    for lay in candidates(shape, global_batch, cluster, choices):
        if not _matches(lay, fixed):
            continue
        seen += 1
        why = refusal(lay, shape, seq_len, global_batch, cluster)
        if why:
            key = why.split(":")[0]
            refused[key] = refused.get(key, 0) + 1
            refusals.append((lay, why))
            continue
        est = estimate(lay, shape, seq_len, global_batch, cluster)
        (fitting if est.fits else too_big).append(est)
    fitting.sort(key=_rank)
    return fitting, too_big, {"layouts": seen, "refused": refused, "too_big": len(too_big), "fit": len(fitting),
                              "refusals": refusals}


def ranked_step(step_s: float) -> float:
    """The step time layouts are ranked by: STEP_DIGITS significant digits (closer steps tie; the cost model is no
    finer than that)."""
    return float(f"{step_s:.{STEP_DIGITS}g}")


def _rank(e: Estimate) -> tuple:
    """Fastest first (ranked_step); on a tie the smaller memory, then fewer model-parallel splits."""
    lay = e.layout
    return (ranked_step(e.step_s), round(e.memory_gb["total"], 6), lay.tp * lay.pp, lay.virtual_stages,
            -lay.micro_batch, lay.dp_replicate, lay.checkpoint_every, not lay.reshard_after_forward, lay.ep)


def plan_layout(cfg: ModelConfig, seq_len: int, global_batch: int, cluster: ClusterConfig,
                fixed: dict[str, Any] | None = None, reference: dict[str, Any] | None = None,
                reference_name: str = "reference") -> LayoutPlan:
    """The fastest layout of ``cluster`` that fits, with the runner-up and a reason per size. ``fixed`` pins Layout
    fields; ``reference`` (Layout fields, the rest chosen as fastest) is evaluated beside the choice. Raises
    PlanError naming what would fit when nothing does."""
    if seq_len > cfg.block_size:
        raise ConfigError(f"batch.seq_len: {seq_len} is longer than model.block_size ({cfg.block_size})")
    fitting, too_big, considered = search(cfg, seq_len, global_batch, cluster, fixed)
    if not fitting:
        raise _no_fit(cfg, seq_len, global_batch, cluster, too_big, considered, fixed)
    best = fitting[0]
    split = lambda e: (e.layout.tp, e.layout.pp)  # noqa: E731 (how the model itself is split)
    runner = next((e for e in fitting if split(e) != split(best)), None) or \
        next((e for e in fitting if e.layout.sizes != best.layout.sizes), None) or next(iter(fitting[1:]), None)
    shape = Shape.of(cfg, seq_len)
    refusals = considered.pop("refusals")
    plan = LayoutPlan(
        cluster=cluster, model=_model_summary(cfg, shape), seq_len=seq_len, global_batch=global_batch, chosen=best,
        runner_up=runner, why=explain(best, fitting, too_big, refusals), considered=considered)
    if reference:
        plan.reference = _reference(cfg, seq_len, global_batch, cluster, reference, reference_name, best)
    return plan


def _model_summary(cfg: ModelConfig, shape: Shape) -> dict:
    return {"family": cfg.family, "params": shape.params, "n_layer": shape.n_layer, "n_embd": shape.n_embd,
            "n_head": shape.n_head, "n_kv_head": shape.n_kv_head, "ffn": shape.ffn, "vocab_size": shape.vocab,
            "flops_per_token": shape.model_flops, "active_params": shape.active_params,
            "n_experts": shape.n_experts, "top_k": shape.top_k}


def _no_fit(cfg: ModelConfig, seq_len: int, global_batch: int, cluster: ClusterConfig, too_big: list[Estimate],
            considered: dict, fixed: dict | None) -> PlanError:
    """The error when nothing fits: what the smallest layout needs, and what would fit instead."""
    pinned = f" with {', '.join(f'{k} {v}' for k, v in fixed.items())}" if fixed else ""
    if not too_big:
        refused = ", ".join(f"{k} ({n})" for k, n in sorted(considered["refused"].items()))
        return PlanError(f"no legal layout of {cluster.gpus} GPUs ({cluster.gpus_per_node} per server) for this model "
                         f"and batch{pinned}: every candidate is refused, by {refused or 'nothing'}; change "
                         f"batch.global_batch ({global_batch}) or the GPU count")
    least = min(too_big, key=lambda e: e.memory_gb["total"])
    mem = least.memory_gb
    more = next((g for g in (cluster.gpus * 2 ** k for k in range(1, 8))
                 if _fits_on(cfg, seq_len, global_batch, dataclasses.replace(cluster, gpus=g), fixed)), None)
    return PlanError(
        f"no layout of {cluster.gpus} x {cluster.gpu}{pinned} fits: the smallest ({least.layout.describe()}) needs "
        f"{mem['total']:.1f} GiB on its {least.peak_rank} pipeline rank (weights {mem['weights']:.1f}, gradients "
        f"{mem['gradients']:.1f}, optimizer {mem['optimizer']:.1f}, activations {mem['activations']:.1f}) but "
        f"{cluster.headroom:.0%} of {cluster.memory_gb:g} GiB is {least.budget_gb:.1f} GiB: use GPUs with at least "
        f"{mem['total'] / cluster.headroom:.0f} GiB, more GPUs, a shorter batch.seq_len ({seq_len}) or a smaller "
        f"model." + (f" {more:,} GPUs of {cluster.memory_gb:g} GiB would fit it at this global_batch." if more else ""))


def _fits_on(cfg: ModelConfig, seq_len: int, global_batch: int, cluster: ClusterConfig, fixed: dict | None) -> bool:
    """Whether some layout of ``cluster`` fits, trying only the leanest settings: micro_batch 1, every block
    checkpointed (and ``fixed``'s settings other than the data-parallel sizes, which follow the GPU count)."""
    shape = Shape.of(cfg, seq_len)
    keep = {k: v for k, v in (fixed or {}).items() if k not in ("dp_shard", "dp_replicate")}
    for lay in candidates(shape, global_batch, cluster, (keep.get("checkpoint_every", 1),)):
        if lay.micro_batch == keep.get("micro_batch", 1) and _matches(lay, keep) and \
                refusal(lay, shape, seq_len, global_batch, cluster) is None and \
                estimate(lay, shape, seq_len, global_batch, cluster).fits:
            return True
    return False


RELAXED = ("checkpoint_every", "reshard_after_forward", "virtual_stages", "micro_batch", "schedule")  # a reference's
# settings the planner may choose instead when the reference does not fit as given, dropped in this order (its mesh
# sizes always stay)


def _reference(cfg: ModelConfig, seq_len: int, global_batch: int, cluster: ClusterConfig, fields: dict[str, Any],
               name: str, best: Estimate) -> dict:
    """The reference layout at its fastest under this cost model (the fields it leaves out chosen). When it does not
    fit or is not legal as given: why, and the fastest with its RELAXED settings chosen in turn until one fits."""
    shape = Shape.of(cfg, seq_len)
    pinned, relaxed, notes = dict(fields), [], []
    while True:
        fitting, too_big, considered = search(cfg, seq_len, global_batch, cluster, pinned)
        if fitting:
            break
        given = "as given" if not relaxed else f"with {', '.join(relaxed)} free"
        if too_big:
            least = min(too_big, key=lambda e: e.memory_gb["total"])
            fastest = min(too_big, key=_rank)
            m = least.memory_gb
            notes.append(f"{given} it does not fit: {least.layout.describe()} needs {m['total']:.1f} GiB on the "
                         f"{least.peak_rank} pipeline rank (activations {m['activations']:.1f}) of "
                         f"{least.budget_gb:.1f} (with the memory, {fastest.layout.describe()} would take "
                         f"{fastest.step_s:.3g} s/step, MFU {fastest.mfu:.1%})")
        else:
            why = considered["refusals"][0][1] if considered["refusals"] else \
                refusal(Layout(**pinned), shape, seq_len, global_batch, cluster) or "no candidate has these fields"
            notes.append(f"{given} it is not legal: {why}")
        drop = next((k for k in RELAXED if k in pinned), None)
        if drop is None:
            return {"name": name, "fields": fields, "relaxed": relaxed, "estimate": None, "fits": False,
                    "note": "; ".join(notes)}
        pinned.pop(drop)
        relaxed.append(drop)
    est = fitting[0]
    instead = ", ".join(f"{k} {_value(k, getattr(est.layout, k))}" for k in relaxed)
    chosen = f"with {instead} instead: " if relaxed else ""
    return {"name": name, "fields": fields, "relaxed": relaxed, "estimate": est, "fits": True,
            "note": "; ".join(notes + [chosen + compare(est, best)])}


# ---------------------------------------------------------------------------------------------------- explanations

PARTS = ("compute", "recompute", "bubble", "tp", "pp", "ep", "dp")


def parts(e: Estimate) -> dict[str, float]:
    """The step's seconds by cause: compute, recompute, bubble, and exposed communication of tp, pp and dp."""
    by = {"compute": e.compute_s, "recompute": e.recompute_s, "bubble": e.bubble_s, "tp": 0.0, "pp": 0.0, "ep": 0.0,
          "dp": 0.0}
    for c in e.comm:
        key = c.name.split(" ", 1)[0] if c.name.startswith(("tp ", "pp ", "ep ")) else "dp"
        by[key] += c.exposed_s
    return by


WORDS = {"compute": "slower matmuls", "recompute": "recomputation", "bubble": "pipeline bubble",
         "tp": "tensor-parallel communication", "pp": "pipeline sends", "ep": "expert all-to-all",
         "dp": "exposed FSDP/DP communication"}


def compare(other: Estimate, best: Estimate) -> str:
    """How ``other`` differs from ``best`` in step time, by its largest causes (and in memory when they tie)."""
    if other.layout == best.layout:
        return "the planner proposes this layout"
    d = other.step_s - best.step_s
    a, b = parts(other), parts(best)
    deltas = sorted(((a[k] - b[k], k) for k in PARTS), reverse=True)
    more = [f"+{x:.3g} s {WORDS[k]}" for x, k in deltas if x > 1e-6][:2]
    less = [f"{x:.3g} s {WORDS[k]}" for x, k in sorted(deltas) if x < -1e-6][:1]
    causes = ", ".join(more + less or ["same causes"])
    if ranked_step(other.step_s) == ranked_step(best.step_s):
        return (f"the same {ranked_step(best.step_s):g} s/step to {STEP_DIGITS} digits ({d:+.2g} s: {causes}) with "
                f"{other.memory_gb['total'] - best.memory_gb['total']:+.2f} GiB per rank")
    sign = "slower" if d > 0 else "faster"
    return f"{abs(d):.3g} s/step {sign} ({100 * abs(d) / best.step_s:.2g}%): {causes}"


FIELDS_EXPLAINED = ("tp", "pp", "dp_shard", "dp_replicate", "ep", "schedule", "virtual_stages", "micro_batch",
                    "checkpoint_every", "reshard_after_forward")


def explain(best: Estimate, fitting: list[Estimate], too_big: list[Estimate],
            refusals: list[tuple[Layout, str]] = ()) -> list[tuple[str, str]]:
    """One sentence per layout field: the fastest layout with another value of it, and what makes it slower; or
    that no other value fits, and how much memory the smallest would need; or why no other value is legal."""
    lay = best.layout
    sparse = any(e.layout.ep > 1 for e in [*fitting, *too_big])  # a mixture of experts: ep is one of the choices
    out = []
    for name in FIELDS_EXPLAINED:
        value = getattr(lay, name)
        if name == "reshard_after_forward" and lay.dp_shard == 1:
            continue
        if name in ("schedule", "virtual_stages") and lay.pp == 1:
            continue
        if name == "ep" and not sparse:
            continue
        alt = next((e for e in fitting if getattr(e.layout, name) != value), None)
        big = [e for e in too_big if getattr(e.layout, name) != value]
        shown = _value(name, value)
        if alt is not None:
            other = _value(name, getattr(alt.layout, name))
            text = f"{shown}; best with {name} {other} ({alt.layout.describe()}): {compare(alt, best)}"
        elif big:
            least = min(big, key=lambda e: e.memory_gb["total"])
            text = (f"{shown}; no other value fits: the smallest, {least.layout.describe()}, needs "
                    f"{least.memory_gb['total']:.1f} GiB of {least.budget_gb:.1f}")
        else:
            others = [(lay_, why) for lay_, why in refusals if getattr(lay_, name) != value]
            nearest = max(others, key=lambda r: sum(getattr(r[0], f) == getattr(lay, f) for f in FIELDS_EXPLAINED),
                          default=None)
            text = f"{shown}; the only legal value" + (
                f": with {name} {_value(name, getattr(nearest[0], name))}, {nearest[1]}" if nearest else "")
        out.append((name, text))
    return out


def _value(name: str, value: Any) -> str:
    if name == "checkpoint_every":
        return {0: "none", 1: "every block"}.get(value, f"every {_nth(value)} block")
    if name == "reshard_after_forward":
        return "re-gathered per micro-batch" if value else "gathered once per step"
    return str(value)


# ---------------------------------------------------------------------------------------------------- text


def describe_cluster(c: ClusterConfig) -> str:
    nodes = -(-c.gpus // c.gpus_per_node)
    return (f"{c.gpus:,} x {c.gpu} ({c.memory_gb:g} GiB, {c.peak_tflops:g} TFLOP/s BF16), {c.gpus_per_node} per server "
            f"in {nodes:,} server{'s' if nodes > 1 else ''}; {c.intra_node_gb_s:g} GB/s per GPU inside a server, "
            f"{c.inter_node_gb_s:g} GB/s between; {c.latency_us:g} us per collective step")


def describe_estimate(e: Estimate, indent: str = "             ") -> list[str]:
    """Memory, communication, bubble, step time and MFU of one estimate as terminal lines."""
    mem = e.memory_gb
    lines = [
        f"memory/rank  {mem['total']:.1f} GiB of {e.budget_gb:.1f} usable ({e.peak_rank} pipeline rank): "
        + ", ".join(f"{k} {v:.2f}" for k, v in mem.items() if k != "total"),
    ]
    for c in e.comm:
        lines.append(f"{'comm/step' if c is e.comm[0] else ''}".ljust(13) +
                     f"{c.name}: {c.gib:,.2f} GiB over {c.group} ranks on {c.link} at {c.gb_s:g} GB/s, "
                     f"{c.seconds:.3g} s ({c.exposed_s:.3g} s exposed)")
    if not e.comm:
        lines.append("comm/step    none (one GPU)")
    lay = e.layout
    if lay.pp > 1:
        lines.append(f"bubble       (pp - 1) / (v x m) = {lay.pp - 1} / ({lay.virtual_stages} x {e.micro_batches}) = "
                     f"{e.bubble:.1%} of the busy time: {e.bubble_s:.3g} s")
    p = parts(e)
    lines.append(f"step         {e.step_s:.3g} s = compute {p['compute']:.3g} + recompute {p['recompute']:.3g} + "
                 f"bubble {p['bubble']:.3g} + exposed comm {e.comm_exposed_s:.3g} ({e.micro_batches} micro-batches of "
                 f"{lay.micro_batch}; matmuls at {e.efficiency:.0%} of peak)")
    lines.append(f"throughput   {e.tokens_per_s:,.0f} tokens/s ({e.tokens_per_s / lay.world:,.0f} per GPU), "
                 f"MFU {e.mfu:.1%}")
    return lines


def describe_layout_plan(plan: LayoutPlan) -> str:
    """A layout plan for a terminal: the model and cluster, the choice and why each size, its figures, the runner-up
    and any reference."""
    md, best = plan.model, plan.chosen
    tokens = plan.global_batch * plan.seq_len
    sparse = (f" ({md['active_params'] / 1e9:,.2f}B active per token)" if md.get("n_experts") else "")
    mlp = (f"{md['n_experts']} experts of {md['ffn']}, {md['top_k']} per token" if md.get("n_experts")
           else f"MLP {md['ffn']}")
    lines = [
        f"model        {md['params'] / 1e9:,.2f}B parameters{sparse} ({md['family']}): {md['n_layer']} blocks x "
        f"{md['n_embd']} wide, {md['n_head']} heads ({md['n_kv_head']} key/value), {mlp}, vocabulary "
        f"{md['vocab_size']:,}; {md['flops_per_token']:.3g} training FLOPs per token (from the active parameters)"
        if md.get("n_experts") else
        f"model        {md['params'] / 1e9:,.2f}B parameters ({md['family']}): {md['n_layer']} blocks x "
        f"{md['n_embd']} wide, {md['n_head']} heads ({md['n_kv_head']} key/value), {mlp}, vocabulary "
        f"{md['vocab_size']:,}; {md['flops_per_token']:.3g} training FLOPs per token",
        f"cluster      {describe_cluster(plan.cluster)}",
        f"batch        {plan.global_batch:,} x {plan.seq_len:,} tokens = {tokens:,} per step",
        f"layout       {best.layout.describe()}",
    ]
    lines += [f"  {name:<22} {text}" for name, text in plan.why]
    lines += describe_estimate(best)
    if plan.runner_up:
        r = plan.runner_up
        lines.append(f"runner-up    {r.layout.describe()}: {r.step_s:.3g} s/step, MFU {r.mfu:.1%}, "
                     f"{r.memory_gb['total']:.1f} GiB; {compare(r, best)}")
    ref = plan.reference
    if ref:
        est = ref["estimate"]
        head = f"reference    {ref['name']}"
        if est is not None and ref["fits"]:
            lines.append(f"{head}: {est.layout.describe()}: {est.step_s:.3g} s/step, MFU {est.mfu:.1%}, "
                         f"{est.memory_gb['total']:.1f} GiB; {ref['note']}")
        else:
            lines.append(f"{head}: {ref['note']}")
    c = plan.considered
    refused = ", ".join(f"{n} by {k}" for k, n in sorted(c["refused"].items()))
    if plan.max_steps:
        gpus = plan.cluster.gpus
        lines.append(f"run          {plan.max_steps:,} steps x {best.step_s:.3g} s = {plan.hours:,.1f} h on "
                     f"{gpus:,} GPU{'s' if gpus > 1 else ''} ({plan.hours * gpus:,.0f} GPU-hours), "
                     f"{plan.max_steps * tokens / 1e9:,.1f}B tokens")
    if plan.pinned:
        lines.append("pinned       " + ", ".join(f"{k} {_value(k, v)}" for k, v in plan.pinned.items()) +
                     " (batch.micro_batch, parallel.activation_checkpointing, parallel.strategy)")
    lines.append(f"considered   {c['layouts']:,} layouts: {c['fit']:,} fit, {c['too_big']:,} too big for memory"
                 + (f", refused: {refused}" if refused else ""))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- config


def layout_from_config(n_vocab: int, model_preset: str = "", model: dict | None = None, batch: dict | None = None,
                       hardware: dict | None = None, parallel: dict | None = None, layout: dict | None = None,
                       where: str = "training_plan") -> LayoutPlan:
    """The layout plan of a ``training_plan`` config block with a ``layout`` block (kiln plan shows it): the model as
    kiln.plan.memory.plan_from_config builds it, the GPUs of ``hardware`` over the links of ``layout``.
    batch.micro_batch, parallel.activation_checkpointing (true: every block; false: none) and parallel.strategy (ddp: dp_shard 1;
    fsdp: dp_replicate 1) pin the matching layout fields; unknown keys are errors naming ``where.<section>.<key>``."""
    cfg = model_from_config(n_vocab, model_preset, model, where)
    bc = from_dict(BatchConfig, batch, f"{where}.batch")
    hw = from_dict(HardwareConfig, hardware, f"{where}.hardware")
    par = from_dict(ParallelConfig, parallel, f"{where}.parallel")
    req = from_dict(LayoutRequest, layout, f"{where}.layout")
    if hw.device != "cuda":
        raise ConfigError(f"{where}.layout plans GPU clusters: set {where}.hardware.device to cuda "
                          f"(not {hw.device!r}), or remove {where}.layout")
    pinned: dict[str, Any] = {}
    if bc.micro_batch:
        pinned["micro_batch"] = bc.micro_batch
    if par.activation_checkpointing is not None:
        pinned["checkpoint_every"] = 1 if par.activation_checkpointing else 0
    if par.strategy in ("ddp", "fsdp"):
        pinned["dp_shard" if par.strategy == "ddp" else "dp_replicate"] = 1
    elif par.strategy != "auto":
        raise ConfigError(f"{where}.parallel.strategy must be auto, ddp or fsdp, not {par.strategy!r}")
    cluster = req.cluster(hw.nproc_per_node, hw.nnodes, hw.memory_gb, hw.peak_tflops, par.headroom, where)
    plan = plan_layout(cfg, bc.seq_len, bc.global_batch, cluster, pinned, req.reference.fields() or None,
                       req.reference_name or "reference")
    plan.max_steps, plan.pinned = bc.max_steps, pinned
    return plan


def training_plan_of(plan: LayoutPlan, cfg: ModelConfig, hardware: dict[str, Any], compile: bool = False,
                     where: str = "training_plan") -> dict[str, Any]:
    """The chosen layout as the training plan base_model launches (kiln.plan.memory.TrainingPlan's fields, with the
    job's ``layout`` and ``pipeline`` blocks when the model is split): world size, micro-batch, gradient accumulation (the
    pipeline's micro-batches), FSDP2 over dp_shard, activation checkpointing. A layout the training job cannot run is
    a ConfigError naming what to pin instead; "every n-th block recomputed" trains with every block recomputed (the
    job's activation checkpointing is all or nothing), which the plan's reason says."""
    from kiln.model.config import model_dict
    from kiln.model.parallel import MeshLayout
    from kiln.model.pipeline_parallel import PipelineConfig
    from kiln.train.job import JobConfig

    best, lay = plan.chosen, plan.chosen.layout
    split = lay.tp > 1 or lay.pp > 1 or lay.ep > 1
    if lay.dp_replicate > 1 and (split or lay.dp_shard > 1):
        raise ConfigError(f"{where}.layout: the plan chose {lay.describe()}, replicating sharded or split copies "
                          f"(HSDP), which the training job does not run; pin {where}.parallel.strategy: fsdp "
                          "(dp_replicate 1) and plan again")
    parallelism = "fsdp" if lay.dp_shard > 1 else "ddp" if lay.dp_replicate > 1 else "none"
    fields = {"micro_batch": lay.micro_batch, "grad_accum": best.micro_batches, "parallelism": parallelism,
              "activation_checkpointing": lay.checkpoint_every > 0, "compile": compile}
    if split:
        fields["layout"] = {"dp_replicate": 1, "dp_shard": lay.dp_shard, "tp": lay.tp, "pp": lay.pp,
                            **({"ep": lay.ep} if lay.ep > 1 else {})}
    if lay.pp > 1:
        fields["pipeline"] = {"schedule": lay.schedule, "virtual_stages": lay.virtual_stages, "microbatches": 0}
    job = JobConfig(model=cfg, seq_len=plan.seq_len, micro_batch=lay.micro_batch, grad_accum=best.micro_batches,
                    parallelism="auto" if parallelism == "none" else parallelism,
                    layout=MeshLayout(**fields["layout"]) if split else MeshLayout(),
                    pipeline=PipelineConfig(**fields.get("pipeline", {})))
    try:
        job.check_layout("job", lay.world)
    except ConfigError as e:
        raise ConfigError(f"{where}.layout: the plan chose {lay.describe()}, which the training job cannot run "
                          f"({e}); pin other sizes through {where}.layout.reference or {where}.parallel") from None
    params, non_embedding = count_params(cfg)
    tokens_per_step = plan.global_batch * plan.seq_len
    total_tokens = tokens_per_step * plan.max_steps
    fpt = flops_per_token(cfg, plan.seq_len)
    reason = f"layout {lay.describe()}: " + "; ".join(f"{name}: {text}" for name, text in plan.why)
    if lay.checkpoint_every > 1:
        reason += (f"; the job recomputes every block where the plan recomputes every {_nth(lay.checkpoint_every)} "
                   "(more recomputation, less memory than estimated)")
    if lay.dp_shard > 1 and not lay.reshard_after_forward:
        reason += ("; the job's FSDP2 reshards the weights after each forward where the plan keeps them gathered "
                   "(less memory, more all-gathers than estimated)")
    runner = plan.runner_up
    return {
        "model": model_dict(cfg), "params": params, "params_non_embedding": non_embedding, "world_size": lay.world,
        **{k: v for k, v in fields.items() if k not in ("layout", "pipeline")},
        "global_batch": plan.global_batch, "seq_len": plan.seq_len, "tokens_per_step": tokens_per_step,
        "total_tokens": total_tokens, "memory_gb": {k: round(v, 4) for k, v in best.memory_gb.items()},
        "device_memory_gb": plan.cluster.memory_gb, "flops_per_token": fpt, "total_flops": fpt * total_tokens,
        "peak_tflops": plan.cluster.peak_tflops, "est_hours": plan.hours, "tokens_per_param": total_tokens / params,
        "reason": reason,
        "alternatives": [{"layout": e.layout.describe(), "step_s": round(e.step_s, 4), "mfu": round(e.mfu, 4),
                          "GiB": round(e.memory_gb["total"], 3)} for e in ([best] + ([runner] if runner else []))],
        "hardware": dict(hardware), "max_steps": plan.max_steps,
        **({"layout": fields["layout"]} if split else {}), **({"pipeline": fields["pipeline"]} if lay.pp > 1 else {}),
    }
