"""The training planner: from model, batch and hardware, the memory it needs and how to run it.

``python -m kiln.plan`` prints the plan for the default (demo) settings.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from kiln.model import GPTConfig, flops_per_token

GIB = 1024**3


@dataclass
class HardwareConfig:
    device: str = "cpu"  # "cpu" or "cuda"; "auto" picks cuda when present
    nproc_per_node: int = 1  # worker processes per node (one per GPU on CUDA)
    nnodes: int = 1  # machines in the job
    memory_gb: float | None = None  # memory per device in GiB; None reads it (host RAM shared by CPU ranks)
    peak_tflops: float | None = None  # per-device peak for MFU; None uses a rough default for the device


@dataclass
class BatchConfig:
    seq_len: int = 256  # tokens per training sequence (at most model.block_size)
    global_batch: int = 16  # sequences per optimizer step, summed over all ranks and accumulation steps
    micro_batch: int | None = None  # sequences per rank per forward pass; None lets the planner choose
    max_steps: int = 800  # optimizer steps to train


@dataclass
class TrainingPlan:
    model: dict
    params: int
    params_non_embedding: int
    world_size: int
    parallelism: str
    micro_batch: int
    grad_accum: int
    global_batch: int
    seq_len: int
    tokens_per_step: int
    total_tokens: int
    memory_gb: dict = field(default_factory=dict)
    device_memory_gb: float = 0.0
    flops_per_token: float = 0.0
    total_flops: float = 0.0
    est_hours: float | None = None
    tokens_per_param: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class PlanError(ValueError):
    """The requested run cannot fit; the message says what would."""


def device_memory_gb(hw: HardwareConfig) -> float:
    if hw.memory_gb:
        return float(hw.memory_gb)
    if hw.device == "cuda":
        import torch

        return torch.cuda.get_device_properties(0).total_memory / GIB
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    return total / max(hw.nproc_per_node, 1)  # CPU ranks share the host's memory


def default_peak_tflops(hw: HardwareConfig) -> float:
    """Rough dense peak per device: bf16 for an H100-class GPU; a few TFLOPS of fp32 for a CPU socket."""
    if hw.peak_tflops:
        return hw.peak_tflops
    return 989.0 if hw.device == "cuda" else 0.5 * max(1, (os.cpu_count() or 1) // max(hw.nproc_per_node, 1))


def memory_breakdown(cfg: GPTConfig, micro_batch: int, seq_len: int, mixed_precision: bool) -> dict[str, float]:
    """Bytes in GiB: weights+grads+AdamW state (16 B/param mixed precision, fp32 master) plus activations.

    Activations per layer follow Korthikanti et al. 2022 (no recomputation): s*b*h*(34 + 5*a*s/h) bytes in
    half precision, doubled for fp32 on CPU; the attention-score term vanishes with fused SDPA kernels but
    is kept as a safety margin. Logits add b*s*V*(4+4) bytes (fp32 logits and their gradient).
    """
    n = count_params(cfg)[0]
    s, b, h, a = seq_len, micro_batch, cfg.n_embd, cfg.n_head
    act_scale = 1.0 if mixed_precision else 2.0
    act = cfg.n_layer * s * b * h * (34 + 5 * a * s / h) * act_scale
    logits = b * s * cfg.vocab_size * 8
    state = n * 16
    return {
        "weights_grads_optimizer": state / GIB,
        "activations": act / GIB,
        "logits": logits / GIB,
        "total": (state + act + logits) / GIB,
    }


def make_plan(cfg: GPTConfig, batch: BatchConfig, hw: HardwareConfig, headroom: float = 0.8) -> TrainingPlan:
    """Choose micro-batch, gradient accumulation and parallelism for ``batch`` on ``hw``.

    Raises PlanError when even one sequence per rank does not fit, naming what would.
    """
    if batch.seq_len > cfg.block_size:
        raise PlanError(f"batch.seq_len={batch.seq_len} exceeds model.block_size={cfg.block_size}; lower seq_len or raise block_size")
    world = hw.nproc_per_node * hw.nnodes
    if batch.global_batch % world:
        raise PlanError(f"batch.global_batch={batch.global_batch} is not divisible by {world} ranks; use a multiple of {world}")
    per_rank = batch.global_batch // world
    mem = device_memory_gb(hw)
    budget = mem * headroom
    mixed = hw.device == "cuda"
    if batch.micro_batch:
        if per_rank % batch.micro_batch:
            raise PlanError(f"batch.micro_batch={batch.micro_batch} must divide the per-rank batch {per_rank}")
        micro = batch.micro_batch
    else:
        micro = per_rank
        while micro > 1 and (per_rank % micro or memory_breakdown(cfg, micro, batch.seq_len, mixed)["total"] > budget):
            micro -= 1
    need = memory_breakdown(cfg, micro, batch.seq_len, mixed)
    if need["total"] > budget:
        raise PlanError(
            f"the model needs {need['total']:.3g} GiB per rank at micro_batch={micro} "
            f"({need['weights_grads_optimizer']:.3g} GiB weights+grads+AdamW, {need['activations']:.3g} GiB activations) "
            f"but a device has {mem:.3g} GiB ({headroom:.0%} usable = {budget:.3g} GiB). {_what_fits(cfg, batch, micro, mixed, budget)} "
            "Otherwise use a smaller model, more devices with FSDP, or devices with more memory."
        )
    params = count_params(cfg)
    tokens_per_step = batch.global_batch * batch.seq_len
    fpt = flops_per_token(cfg, batch.seq_len)
    total_tokens = tokens_per_step * batch.max_steps
    peak = default_peak_tflops(hw) * 1e12 * world
    return TrainingPlan(
        model=asdict(cfg),
        params=params[0],
        params_non_embedding=params[1],
        world_size=world,
        parallelism="none" if world == 1 else "ddp",
        micro_batch=micro,
        grad_accum=per_rank // micro,
        global_batch=batch.global_batch,
        seq_len=batch.seq_len,
        tokens_per_step=tokens_per_step,
        total_tokens=total_tokens,
        memory_gb={k: round(v, 4) for k, v in need.items()},
        device_memory_gb=round(mem, 2),
        flops_per_token=fpt,
        total_flops=fpt * total_tokens,
        est_hours=fpt * total_tokens / (peak * (0.4 if hw.device == "cuda" else 0.25)) / 3600,
        tokens_per_param=total_tokens / params[0],
    )


def _what_fits(cfg: GPTConfig, batch: BatchConfig, micro: int, mixed: bool, budget: float) -> str:
    """One sentence naming a run that would fit: the longest seq_len, or the largest model if none does."""
    def fits(seq: int) -> bool:
        return memory_breakdown(cfg, micro, seq, mixed)["total"] <= budget

    if fits(1):
        lo, hi = 1, batch.seq_len  # fits(lo) and not fits(hi); memory grows with seq_len
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return f"This model fits at micro_batch={micro} with seq_len<={lo}."
    max_params = budget * GIB / 16  # weights+grads+AdamW alone, before any activations
    return (f"Even seq_len=1 does not fit: weights+grads+AdamW alone allow at most {max_params / 1e6:.3g}M "
            f"parameters per device (this model has {count_params(cfg)[0] / 1e6:.3g}M).")


def count_params(cfg: GPTConfig) -> tuple[int, int]:
    """(total parameters with tied embeddings, parameters excluding embeddings)."""
    # 12 C^2 of matrices; 4 LayerNorm vectors (2 without bias) + 9 C of Linear biases (none without bias)
    per_layer = 12 * cfg.n_embd**2 + (13 * cfg.n_embd if cfg.bias else 2 * cfg.n_embd)
    body = cfg.n_layer * per_layer + (2 if cfg.bias else 1) * cfg.n_embd
    return body + (cfg.vocab_size + cfg.block_size) * cfg.n_embd, body


if __name__ == "__main__":
    import json

    print(json.dumps(make_plan(GPTConfig(), BatchConfig(), HardwareConfig()).to_dict(), indent=2))
