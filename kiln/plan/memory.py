"""The single-node planner: from model, batch and hardware, the memory a rank needs and how to run it (DDP or FSDP2,
activation checkpointing, micro-batch, accumulation), with its FLOPs and hours. ``python -m kiln.plan`` prints it.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Annotated

from kiln.common.config import ConfigError, Domain, from_dict
from kiln.common.files import stable_hash
from kiln.model.config import ModelConfig, model_dict, padded_vocab, preset_fields
from kiln.model.families import flops_per_token, of
from kiln.model.loss import CE_CHUNK_BYTES

GIB = 1024**3

# Dense BF16 tensor-core peak per GPU in TFLOP/s, from the vendors' data sheets (no sparsity). Matched as
# substrings of torch.cuda.get_device_name(), first match wins, so the more specific names come first.
GPU_PEAK_TFLOPS: list[tuple[str, float]] = [
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H800", 989.4),
    ("GH200", 989.4),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.1),
    ("L4", 121.0),
    ("A10", 125.0),
    ("MI300X", 1307.4),
]
DEFAULT_GPU = "H100"  # assumed when planning for CUDA on a machine without one
# Memory the libraries take on first use whatever the model: on CPU oneDNN/MKL scratch buffers and the autograd
# engine (about 0.1 GiB, measured with kiln.train.loop on one thread); on CUDA the context, cuBLAS and NCCL workspaces.
RUNTIME_GIB = {"cpu": 0.1, "cuda": 1.0}


@dataclass
class HardwareConfig:
    device: str = "cpu"  # "cpu" or "cuda"; "auto" picks cuda when present
    nproc_per_node: Annotated[int, Domain(1)] = 1  # worker processes per node (one per GPU on CUDA)
    nnodes: Annotated[int, Domain(1)] = 1  # machines in the job
    memory_gb: Annotated[float | None, Domain(0, low_open=True, none=True)] = None  # memory per device in GiB; None reads it (host RAM shared by CPU ranks)
    peak_tflops: Annotated[float | None, Domain(0, low_open=True, none=True)] = None  # per-device peak for MFU and the time estimate; None: GPU table / CPU guess


@dataclass
class BatchConfig:
    seq_len: Annotated[int, Domain(1)] = 256  # tokens per training sequence (at most model.block_size)
    global_batch: Annotated[int, Domain(1)] = 8  # sequences per optimizer step, summed over all ranks and accumulation steps
    micro_batch: Annotated[int | None, Domain(1, none=True)] = None  # sequences per rank per forward pass; None lets the planner choose
    max_steps: Annotated[int, Domain(1)] = 700  # optimizer steps to train


@dataclass
class ParallelConfig:
    strategy: str = "auto"  # "auto", "ddp" (replicate the model) or "fsdp" (FSDP2 fully_shard); one rank runs unwrapped
    activation_checkpointing: bool | None = None  # recompute block activations in backward; None: only when needed
    compile: bool = False  # torch.compile each transformer block (CPU needs a C++ compiler)
    # on CPU, forward and backward under bf16 autocast (weights, gradients and optimizer state stay fp32); None: where
    # the planning machine's CPU multiplies bf16 natively (native_cpu_bf16: AVX-512 BF16 or AMX), not where it
    # emulates it (AVX2: slower than fp32). Single-node plans; a layout plan trains in fp32 on CPU
    cpu_bf16: bool | None = None
    saturating_tokens: Annotated[int | None, Domain(1, none=True)] = None  # micro_batch x seq_len that keeps a device busy (None: 16384 on CUDA, 1024 on CPU)
    headroom: Annotated[float, Domain(0, 1, low_open=True)] = 0.8  # share of device memory the plan may use (the rest covers allocator slack, buffers)


@dataclass
class TrainingPlan:
    model: dict
    params: int
    params_non_embedding: int
    world_size: int
    parallelism: str  # "none", "ddp" or "fsdp"
    activation_checkpointing: bool
    compile: bool
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
    peak_tflops: float = 0.0
    est_hours: float | None = None
    tokens_per_param: float | None = None
    reason: str = ""  # why this parallelism and checkpointing were chosen
    alternatives: list = field(default_factory=list)  # the other options considered: micro-batch and GiB each
    cpu_bf16: bool | None = None  # True: a CPU run under bf16 autocast (ParallelConfig.cpu_bf16); None: fp32 or CUDA

    def to_dict(self) -> dict:
        """The plan's fields; cpu_bf16 only when set, so a plan without it hashes as one made before it existed."""
        out = asdict(self)
        if out["cpu_bf16"] is None:
            del out["cpu_bf16"]
        return out


HOST_ESTIMATES = ("device_memory_gb", "peak_tflops", "est_hours", "alternatives")
# What a plan says about its run without deciding it: the scaling ladder's prediction of its loss (a ladder
# materialized after the model trained must not make the same run a new one)
PREDICTIONS = ("scaling",)


def plan_version(plan: dict) -> str:
    """The data version of a plan (the ``to_dict`` of a TrainingPlan, with any fields the caller adds): a hash of
    what the run will do, without HOST_ESTIMATES, which follow the planning host's memory and cores when
    hardware.memory_gb or peak_tflops is unset (the same run planned on another machine keeps its version)."""
    return stable_hash({k: v for k, v in plan.items() if k not in HOST_ESTIMATES + PREDICTIONS})[:16]


class PlanError(ValueError):
    """The requested run cannot fit; the message says what would."""


def gpu_peak_tflops(name: str) -> float | None:
    """Dense BF16 peak of a GPU from its device name, or None when it is not in the table."""
    for key, tflops in GPU_PEAK_TFLOPS:
        if key.lower() in name.lower():
            return tflops
    return None


def device_memory_gb(hw: HardwareConfig) -> float:
    if hw.memory_gb:
        return float(hw.memory_gb)
    if hw.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise PlanError("training_plan.hardware.device is cuda but no GPU is visible here: "
                            "set hardware.memory_gb (e.g. 80 for an H100) to plan for GPUs elsewhere")
        return torch.cuda.get_device_properties(0).total_memory / GIB
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    return total / max(hw.nproc_per_node, 1)  # CPU ranks share the host's memory


def default_peak_tflops(hw: HardwareConfig) -> float:
    """Per-device peak: the configured one; the GPU table (an H100 when no GPU is visible); for a CPU a rough
    guess of 0.18 TFLOP/s per core, an AVX-512 core with two FMA units (measured here: 0.35 TFLOP/s on two cores;
    the training job measures the real matmul peak for its MFU)."""
    if hw.peak_tflops:
        return hw.peak_tflops
    if hw.device == "cuda":
        import torch

        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else DEFAULT_GPU
        return gpu_peak_tflops(name) or gpu_peak_tflops(DEFAULT_GPU)  # type: ignore[return-value]
    return 0.18 * max(1, (os.cpu_count() or 1) // max(hw.nproc_per_node, 1))


def measure_matmul_peak(device: str = "cpu", dtype=None, seconds: float = 0.3, n: int = 1024) -> float:
    """Best FLOP/s of square ``n x n`` matmuls on this device over about ``seconds`` (the MFU yardstick on CPU).

    Best-of rather than mean: on a shared machine the fastest repetition is the closest to what the
    hardware can do; training throughput is measured the same way by the benchmark.
    """
    import torch

    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    g = torch.Generator(device=device).manual_seed(0)  # never the global RNG: a resumed run must draw as before
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    out = torch.empty(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.mm(a, b, out=out)  # warm-up: kernel selection, thread pool start
    sync()
    best, deadline = float("inf"), time.perf_counter() + seconds
    reps = 0
    while reps < 3 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        sync()
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return 2 * n**3 / best


def layer_params(cfg: ModelConfig) -> int:
    """Parameters of one transformer block of ``cfg``'s family (kiln.model.families.Counts.layer_params)."""
    return of(cfg).counts.layer_params(cfg)


def embedding_params(cfg: ModelConfig) -> int:
    """Parameters of the tables and the head, a tied head counted once: GPT-2's token and position tables; llama's
    token table, plus its output head when untied."""
    return of(cfg).counts.embedding_params(cfg)


def count_params(cfg: ModelConfig) -> tuple[int, int]:
    """(total parameters, tied ones counted once; parameters excluding the embedding tables and the head)."""
    body = cfg.n_layer * layer_params(cfg) + of(cfg).counts.final_norm_params(cfg)
    return body + embedding_params(cfg), body


def saved_per_token(cfg: ModelConfig) -> tuple[int, int]:
    """(elements autograd keeps per token per block, of which residual-stream elements): see memory_breakdown."""
    return of(cfg).counts.saved_per_token(cfg)


def memory_breakdown(cfg: ModelConfig, micro_batch: int, seq_len: int, mixed_precision: bool, world: int = 1,
                     fsdp: bool = False, activation_checkpointing: bool = False) -> dict[str, float]:
    """Peak GiB per rank, by part, for this model at this micro-batch (the peak is at the start of backward).

    weights_grads_optimizer: fp32 weights, gradients and AdamW's two moments (16 B/parameter), divided by the
      world size under FSDP, plus the bf16 weight copies autocast caches (2 B/parameter) when not sharded.
    params_in_flight (FSDP): the root (embeddings, final norm) and two blocks unsharded, with their gradients.
    activations: what autograd keeps per block per token, counted tensor by tensor for this model (cf.
      Korthikanti et al. 2022, Table 2, with fused SDPA so no T x T scores; saved_per_token): for GPT-2 the
      block input, LN outputs, q/k/v, the attention output and its contiguous copy, the MLP's 4C hidden before
      and after GELU = 17 C elements; for llama 9 C + 2 kv + 4 I (GQA's narrower k and v, SwiGLU's three
      I-wide tensors and their product). fp32 on CPU (4 B each: 68 C bytes for GPT-2), bf16 autocast with the
      fp32 residual stream (2 C) on CUDA (38 C bytes), bf16 throughout under FSDP's mixed precision (34 C bytes). Dropout adds its masks (2 C bytes) and on CPU
      the unfused attention's scores (13 B per score). With recomputation only each block's input is kept,
      plus one block's full set while it is recomputed.
    logits: the chunked head never holds all logits: one chunk of fp32 logits (and its bf16 or fp32 copy for the
      gradient matmuls), plus the head's gradients for the weights (V x C fp32) and the hidden states (fp32).
    runtime: what the libraries allocate on first use, the same for any model (RUNTIME_GIB).
    """
    n = count_params(cfg)[0]
    s, b, c, L = seq_len, micro_batch, cfg.n_embd, cfg.n_layer
    tokens = s * b
    saved, resid = saved_per_token(cfg)  # elements per token per block
    if fsdp and mixed_precision:
        per_layer = 2 * saved  # bytes per token
        stream = 2 * c
    elif mixed_precision:
        per_layer, stream = 2 * (saved - resid) + 4 * resid, 4 * c
    else:
        per_layer, stream = 4 * saved, 4 * c
    if cfg.dropout > 0:
        per_layer += 2 * c + (0 if mixed_precision else 13 * cfg.n_head * s)
    if activation_checkpointing:
        act = tokens * (L * stream + per_layer)
    else:
        act = tokens * L * per_layer
    act += tokens * 3 * stream  # embeddings sum, final norm input and output
    # the chunked head (kiln.model.loss.LinearCrossEntropy): one chunk of fp32 logits and its cast for the gradient
    # matmuls, plus the head's gradients, computed in the forward pass and kept until backward
    chunk = max(16, CE_CHUNK_BYTES["cuda" if mixed_precision else "cpu"] // (4 * cfg.vocab_size))
    logits = min(tokens, chunk) * cfg.vocab_size * (6 if mixed_precision else 8) + cfg.vocab_size * c * 4 + tokens * c * 4
    if fsdp and world > 1:
        state = n * 16 / world
        p_bytes = 2 if mixed_precision else 4
        block = layer_params(cfg)
        root = embedding_params(cfg) + 2 * c  # tables, head and the final norm (counted as weight and bias)
        in_flight = (root + 2 * block) * (p_bytes + 4)  # unsharded params and their fp32 gradients before reduce-scatter
    else:
        state = n * (18 if mixed_precision else 16)
        in_flight = 0
    out = {"weights_grads_optimizer": state / GIB, "activations": act / GIB, "logits": logits / GIB,
           "runtime": RUNTIME_GIB["cuda" if mixed_precision else "cpu"]}
    if in_flight:
        out["params_in_flight"] = in_flight / GIB
    out["total"] = sum(out.values())
    return out


@dataclass
class _Option:
    parallelism: str
    activation_checkpointing: bool
    micro_batch: int  # 0 when even one sequence does not fit
    memory: dict


def _options(cfg: ModelConfig, batch: BatchConfig, hw: HardwareConfig, par: ParallelConfig, per_rank: int,
             world: int, budget: float) -> list[_Option]:
    """Every allowed (parallelism, checkpointing) pair in order of cost, each with its largest fitting micro-batch."""
    mixed = hw.device == "cuda"
    if par.strategy not in ("auto", "ddp", "fsdp"):
        raise PlanError(f"training_plan.parallel.strategy must be auto, ddp or fsdp, not {par.strategy!r}")
    if world == 1:
        strategies = ["none"]
    elif par.strategy == "auto":
        strategies = ["ddp", "fsdp"]
    else:
        strategies = [par.strategy]
    ac_choices = [False, True] if par.activation_checkpointing is None else [bool(par.activation_checkpointing)]
    options = []
    for ac in ac_choices:  # recomputation costs a third more compute, sharding only communication: shard first
        for strategy in strategies:
            def need(m: int) -> dict:
                return memory_breakdown(cfg, m, batch.seq_len, mixed, world, strategy == "fsdp", ac)

            if batch.micro_batch:
                candidates = [batch.micro_batch]
            else:
                candidates = [m for m in range(per_rank, 0, -1) if per_rank % m == 0]
            micro = next((m for m in candidates if need(m)["total"] <= budget), 0)
            options.append(_Option(strategy, ac, micro, need(micro or 1)))
    return options


def avx512_cpu_kernels() -> bool:
    """Whether torch's CPU kernels run at AVX-512 here (``torch.backends.cpu.get_cpu_capability()``): not on an
    AVX2 CPU, nor on an AVX-512 one whose kernels are held to AVX2 (ATEN_CPU_CAPABILITY=avx2)."""
    import torch

    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def native_cpu_bf16() -> bool:
    """Whether this machine's CPU multiplies bf16 natively (AVX-512 BF16 or AMX tiles, as torch's cpuinfo reads
    them): there bf16 autocast trains the demo model about 1.4x faster than fp32 (bench/results/nanogpt_bf16_seed2.md);
    an AVX2 CPU emulates bf16 and would be slower. False too where torch's kernels are held below AVX-512
    (ATEN_CPU_CAPABILITY=avx2), as they are to measure the AVX2 path on an AVX-512 CPU."""
    import torch

    if not avx512_cpu_kernels():
        return False
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private, but torch's own; absent: False
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def cpu_bf16_choice(par: ParallelConfig, hw: HardwareConfig) -> bool | None:
    """The plan's cpu_bf16: True for a CPU run that asked for it or, unset, on a CPU with native bf16; None
    otherwise (CUDA runs choose their own precision), so a plan without it hashes as before."""
    if hw.device != "cpu":
        return None
    wanted = native_cpu_bf16() if par.cpu_bf16 is None else par.cpu_bf16
    return True if wanted else None


def make_plan(cfg: ModelConfig, batch: BatchConfig, hw: HardwareConfig, parallel: ParallelConfig | None = None,
              headroom: float | None = None) -> TrainingPlan:
    """Choose parallelism, activation checkpointing, micro-batch and gradient accumulation for ``batch`` on ``hw``.

    Options are tried cheapest first: replicate (DDP), shard (FSDP2), then each again with activation
    checkpointing. The first whose micro-batch reaches ``saturating_tokens`` (or the whole per-rank batch) wins;
    if none does, the one with the largest micro-batch. Raises PlanError when nothing fits, naming what would.
    """
    par = parallel or ParallelConfig()
    headroom = par.headroom if headroom is None else headroom
    world, per_rank = _ranks(cfg, batch, hw)
    mem = device_memory_gb(hw)
    budget = mem * headroom
    options = _options(cfg, batch, hw, par, per_rank, world, budget)
    if not any(o.micro_batch for o in options):
        raise _no_fit(cfg, batch, hw, par, world, options, mem, headroom)
    chosen, why = _choose(options, batch, hw, par, per_rank)
    return _plan(cfg, batch, hw, par, world, per_rank, mem, chosen, why, options)


def _ranks(cfg: ModelConfig, batch: BatchConfig, hw: HardwareConfig) -> tuple[int, int]:
    """(world size, sequences per rank per step), after checking that the batch splits evenly over the ranks."""
    if batch.seq_len > cfg.block_size:
        raise PlanError(f"batch.seq_len={batch.seq_len} exceeds model.block_size={cfg.block_size}; lower seq_len or raise block_size")
    world = hw.nproc_per_node * hw.nnodes
    if batch.global_batch % world:
        raise PlanError(f"batch.global_batch={batch.global_batch} is not divisible by {world} ranks; use a multiple of {world}")
    per_rank = batch.global_batch // world
    if batch.micro_batch and per_rank % batch.micro_batch:
        raise PlanError(f"batch.micro_batch={batch.micro_batch} must divide the per-rank batch {per_rank}")
    return world, per_rank


def _no_fit(cfg: ModelConfig, batch: BatchConfig, hw: HardwareConfig, par: ParallelConfig, world: int,
            options: list[_Option], mem: float, headroom: float) -> PlanError:
    """The error for a run where no option fits: what the smallest one needs, and what would fit instead."""
    budget = mem * headroom
    best = min(options, key=lambda o: o.memory["total"])
    need = best.memory
    return PlanError(
        f"the model needs {need['total']:.3g} GiB per rank at micro_batch={batch.micro_batch or 1} "
        f"({need['weights_grads_optimizer']:.3g} GiB weights+grads+AdamW, {need['activations']:.3g} GiB activations, "
        f"{need['logits']:.3g} GiB logits; {best.parallelism}, activation checkpointing "
        f"{'on' if best.activation_checkpointing else 'off'}) but a device has {mem:.3g} GiB ({headroom:.0%} usable = "
        f"{budget:.3g} GiB). {_what_fits(cfg, batch, hw, par, world, budget)}"
    )


def _choose(options: list[_Option], batch: BatchConfig, hw: HardwareConfig, par: ParallelConfig,
            per_rank: int) -> tuple[_Option, str]:
    """The first fitting option whose micro-batch keeps a device busy, else the largest micro-batch; and why."""
    fitting = [o for o in options if o.micro_batch]
    saturating = par.saturating_tokens or (16384 if hw.device == "cuda" else 1024)
    enough = min(per_rank, max(1, saturating // batch.seq_len))
    chosen = next((o for o in fitting if o.micro_batch >= enough), None)
    if chosen is not None:
        why = (f"{chosen.parallelism} fits micro_batch={chosen.micro_batch} "
               f"({chosen.micro_batch * batch.seq_len} tokens per pass, enough to keep a device busy)")
    else:
        chosen = max(fitting, key=lambda o: o.micro_batch)  # max keeps the first (cheapest) on ties
        why = f"{chosen.parallelism} gives the largest micro_batch that fits ({chosen.micro_batch})"
    if chosen.activation_checkpointing:
        why += "; activation checkpointing " + ("requested" if par.activation_checkpointing else "needed to fit")
    return chosen, why


def _plan(cfg: ModelConfig, batch: BatchConfig, hw: HardwareConfig, par: ParallelConfig, world: int, per_rank: int,
          mem: float, chosen: _Option, why: str, options: list[_Option]) -> TrainingPlan:
    """The chosen option as a TrainingPlan: batch split, memory, FLOPs and the time it should take."""
    params = count_params(cfg)
    tokens_per_step = batch.global_batch * batch.seq_len
    fpt = flops_per_token(cfg, batch.seq_len) * (4 / 3 if chosen.activation_checkpointing else 1)
    total_tokens = tokens_per_step * batch.max_steps
    peak_tflops = default_peak_tflops(hw)
    mfu_guess = 0.4  # sustained MFU to expect: GPT-2 on H100s with bf16; Kiln's demo model measured 45% on CPU
    return TrainingPlan(
        model=model_dict(cfg),
        params=params[0],
        params_non_embedding=params[1],
        world_size=world,
        parallelism=chosen.parallelism,
        activation_checkpointing=chosen.activation_checkpointing,
        compile=par.compile,
        micro_batch=chosen.micro_batch,
        grad_accum=per_rank // chosen.micro_batch,
        global_batch=batch.global_batch,
        seq_len=batch.seq_len,
        tokens_per_step=tokens_per_step,
        total_tokens=total_tokens,
        memory_gb={k: round(v, 4) for k, v in chosen.memory.items()},
        device_memory_gb=round(mem, 2),
        flops_per_token=fpt,
        total_flops=fpt * total_tokens,
        peak_tflops=peak_tflops,
        est_hours=fpt * total_tokens / (peak_tflops * 1e12 * world * mfu_guess) / 3600,
        tokens_per_param=total_tokens / params[0],
        reason=why,
        alternatives=[{"parallelism": o.parallelism, "activation_checkpointing": o.activation_checkpointing,
                       "micro_batch": o.micro_batch, "GiB": round(o.memory["total"], 3)} for o in options],
        cpu_bf16=cpu_bf16_choice(par, hw),
    )


def plan_from_config(n_vocab: int, model_preset: str = "", model: dict | None = None, batch: dict | None = None,
                     hardware: dict | None = None, parallel: dict | None = None,
                     where: str = "training_plan") -> tuple[TrainingPlan, ModelConfig, BatchConfig, HardwareConfig]:
    """The plan for a ``training_plan`` config block (model preset and overrides, batch, hardware, parallel) and a
    tokenizer of ``n_vocab`` tokens: what the training_plan asset and ``kiln plan`` both compute. Unknown keys
    are errors naming ``where.<section>.<key>``; device "auto" becomes cuda when a GPU is visible."""
    cfg = model_from_config(n_vocab, model_preset, model, where)
    bc = from_dict(BatchConfig, batch, f"{where}.batch")
    hw = from_dict(HardwareConfig, hardware, f"{where}.hardware")
    par = from_dict(ParallelConfig, parallel, f"{where}.parallel")
    if hw.device == "auto":
        import torch

        hw.device = "cuda" if torch.cuda.is_available() else "cpu"
    return make_plan(cfg, bc, hw, par), cfg, bc, hw


def model_from_config(n_vocab: int, model_preset: str = "", model: dict | None = None,
                      where: str = "training_plan") -> ModelConfig:
    """The ModelConfig of a ``training_plan`` block's model preset and overrides for a tokenizer of ``n_vocab``
    tokens; a bad field is a ConfigError naming ``where``."""
    family = (model or {}).get("family", "gpt2")
    try:
        base = preset_fields(model_preset, family) if model_preset else {}
        return from_dict(ModelConfig, {"vocab_size": padded_vocab(n_vocab), **base, **(model or {})}, f"{where}.model")
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # a field the family does not use, an unknown family or size, a bad shape
        raise ConfigError(f"{where}: {e}") from e


def _family_note(model: dict) -> str:
    """What a plan of a family other than GPT-2 adds to the model line (a GPT-2 plan, family unset, adds nothing)."""
    if not model.get("family"):
        return ""
    parts = [f"{model['n_kv_head']} key/value heads"] if "n_kv_head" in model else []
    if "intermediate_size" in model:
        parts.append(f"SwiGLU {model['intermediate_size']} wide")
    if "n_experts" in model:  # a mixture of experts: the routed experts, and the parameters a token passes through
        from kiln.model.config import ModelConfig
        from kiln.model.moe.counts import tensor_count

        cfg = ModelConfig(**model)
        parts[-1] = (f"{cfg.n_experts} SwiGLU experts of {cfg.moe_intermediate_size}, {cfg.n_experts_per_token} per "
                     f"token ({tensor_count(cfg)['active'] / 1e6:,.1f}M parameters active per token)")
    if "tie_embeddings" in model:
        qk = ", QK-norm" if model.get("qk_norm") or model.get("family") == "moe" else ""
        parts.append(f"{'tied' if model['tie_embeddings'] else 'untied'} head{qk}")
    return f"; {model['family']}: " + ", ".join(parts)


def describe_plan(plan: TrainingPlan) -> str:
    """A plan as a few lines for a terminal: decisions first, then memory per rank and the options considered."""
    mem = plan.memory_gb
    lines = [
        f"model        {plan.params / 1e6:,.1f}M parameters ({plan.params_non_embedding / 1e6:,.1f}M non-embedding): "
        f"{plan.model['n_layer']} layers x {plan.model['n_head']} heads x {plan.model['n_embd']} wide, "
        f"vocabulary {plan.model['vocab_size']:,}" + _family_note(plan.model),
        f"ranks        {plan.world_size}: {plan.parallelism}"
        f"{', activation checkpointing' if plan.activation_checkpointing else ''}{', torch.compile' if plan.compile else ''}"
        f"{', bf16 autocast on CPU' if plan.cpu_bf16 else ''}",
        f"batch        {plan.global_batch} x {plan.seq_len} tokens = micro_batch {plan.micro_batch} x grad_accum "
        f"{plan.grad_accum} x {plan.world_size} ranks ({plan.tokens_per_step:,} tokens per step)",
        f"why          {plan.reason}",
        f"memory/rank  {mem['total']:.2f} GiB of {plan.device_memory_gb:g} GiB: "
        + ", ".join(f"{k} {v:.2f}" for k, v in mem.items() if k != "total"),
        f"tokens       {plan.total_tokens:,} ({plan.tokens_per_param:.1f} per parameter)",
        f"compute      {plan.total_flops:.3g} FLOPs; {plan.peak_tflops:g} TFLOP/s peak per device at "
        f"{plan.total_flops / (plan.est_hours * 3600 * plan.peak_tflops * 1e12 * plan.world_size):.0%} MFU: "
        f"about {plan.est_hours:.3g} h" if plan.est_hours else "",
        "considered   " + "; ".join(
            f"{a['parallelism']}{'+AC' if a['activation_checkpointing'] else ''} micro_batch {a['micro_batch']} "
            f"({a['GiB']:.2f} GiB)" if a["micro_batch"] else
            f"{a['parallelism']}{'+AC' if a['activation_checkpointing'] else ''} does not fit"
            for a in plan.alternatives),
    ]
    return "\n".join(x for x in lines if x) + "\n"


def _what_fits(cfg: ModelConfig, batch: BatchConfig, hw: HardwareConfig, par: ParallelConfig, world: int,
               budget: float) -> str:
    """Sentences naming runs that would fit: a shorter seq_len, FSDP over more devices, or a smaller model."""
    mixed = hw.device == "cuda"
    micro = batch.micro_batch or 1
    ac = par.activation_checkpointing is not False
    fsdp = world > 1 and par.strategy != "ddp"
    hints = []

    def fits(seq: int, w: int = world, shard: bool = fsdp) -> bool:
        return memory_breakdown(cfg, micro, seq, mixed, w, shard, ac)["total"] <= budget

    if fits(1):
        lo, hi = 1, batch.seq_len  # fits(lo) and not fits(hi); memory grows with seq_len
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        hints.append(f"This model fits at micro_batch={micro} with seq_len<={lo}.")
    if par.strategy != "ddp":
        for w in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
            if w > world and fits(batch.seq_len, w, True):
                hints.append(f"With FSDP over {w} devices (nproc_per_node x nnodes) it fits at seq_len={batch.seq_len}.")
                break
    max_params = budget * GIB / 16  # weights+grads+AdamW alone, before any activations
    if not hints:
        hints.append(f"Even seq_len=1 does not fit: weights+grads+AdamW alone allow at most {max_params / 1e6:.3g}M "
                     f"parameters per device (this model has {count_params(cfg)[0] / 1e6:.3g}M).")
    return " ".join(hints) + " Otherwise use a smaller model or devices with more memory."
