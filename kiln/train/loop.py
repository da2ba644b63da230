"""The training job: pretraining on token shards or supervised fine-tuning, on one process, many, or many nodes.

One process:   python -m kiln.train --config job.json
Several:       python -m torch.distributed.run --nproc_per_node=2 -m kiln.train --config job.json
Several nodes: torchrun --nnodes=2 --node_rank=R --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT -m kiln.train ...
Rank 0 reads the job file and broadcasts it, so every rank trains with the same settings. A rerun of the same
command resumes from the newest good checkpoint; a loss spike rolls back to an earlier one and skips data.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import resource
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kiln.train.checkpoint import Checkpointer, list_checkpoints, resolve_checkpoint, rng_state, set_rng_state, step_of
from kiln.common.config import from_dict
from kiln.train.goodput import GoodputLedger, summarize
from kiln.model.gpt import GPT, GPTConfig, flops_per_token
from kiln.model.parallel import clip_grad_norm, describe, gradient_sync, param_digest, parallelize
from kiln.train.spikes import SpikeConfig, SpikeDetector, SpikeError
from kiln.common.files import atomic_write_json


@dataclass
class OptimConfig:
    lr: float = 2e-3  # peak learning rate after warmup
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at max_steps
    warmup_steps: int = 50  # linear warmup from 0 to lr
    weight_decay: float = 0.1  # AdamW decay on matrices (not on biases, norms)
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    grad_clip: float = 1.0  # clip the global gradient norm to this (0 disables)


@dataclass
class JobConfig:
    task: str = "pretrain"  # "pretrain" on token shards or "sft" on instruction pairs
    out_dir: str = ""  # run folder: checkpoints/, result.json, goodput.jsonl
    tokenizer: str = ""  # tokenizer.json copied into every checkpoint
    model: dict = field(default_factory=dict)  # GPTConfig fields
    optim: dict = field(default_factory=dict)  # OptimConfig fields
    train_files: list = field(default_factory=list)  # token shards (pretrain) or one instruction JSONL (sft)
    val_files: list = field(default_factory=list)  # validation shards; for sft the same JSONL (split=val)
    seq_len: int = 256  # tokens per sequence
    micro_batch: int = 8  # sequences per rank per forward
    grad_accum: int = 1  # micro-batches per optimizer step
    max_steps: int = 100  # optimizer steps
    parallelism: str = "auto"  # "auto" (ddp on several ranks), "none", "ddp" or "fsdp"; one rank always runs "none"
    activation_checkpointing: bool = False  # recompute block activations in backward to save memory
    compile: bool = False  # torch.compile each block
    eval_interval: int = 50  # steps between validation passes
    eval_batches: int = 8  # micro-batches per validation pass
    ckpt_interval: int = 100  # steps between checkpoints (the last step is always saved)
    keep_last: int = 2  # newest checkpoints kept on disk (0 keeps all)
    keep_every: int = 0  # also keep every checkpoint whose step is a multiple of this (0: none)
    async_save: bool = True  # write checkpoints in the background while training continues
    spikes: dict = field(default_factory=dict)  # kiln.train.spikes.SpikeConfig fields: thresholds, rollback, skip
    log_interval: int = 10  # steps between progress lines
    seed: int = 1337  # seeds init, data order and dropout
    init_from: str = ""  # checkpoint whose weights start this run (fine-tuning)
    mlflow_tracking_uri: str = ""  # where rank 0 streams metrics
    mlflow_run_id: str = ""  # the MLflow run that receives them
    peak_flops: float = 0.0  # per-device peak FLOP/s for MFU; 0: GPU table, or a matmul measured on CPU; <0: no MFU
    fail_at_step: int = -1  # testing aid: raise at this step once (simulates a crash)
    kill_at_steps: list = field(default_factory=list)  # testing aid: rank 0 SIGKILLs itself at these steps, once each
    save_pause_s: float = 0.0  # testing aid: pause inside each checkpoint write (a window for kill-during-save tests)
    inject_spike: dict = field(default_factory=dict)  # testing aid: {"batch": k, "lr_factor": f}: train data batch k at f x lr


MAX_SKIPPED_IN_A_ROW = 10  # spiking updates dropped back to back (no checkpoint yet) before the run gives up


class NullLogger:
    """Stands in for kiln.common.metrics.MetricLogger on ranks that do not report, or when no MLflow run is given."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def log_params(self, params: dict[str, Any]) -> None: ...

    def flush(self) -> None: ...


def make_logger(job: JobConfig, info: DistInfo):
    """Rank 0's batched MLflow logger; MLflow is imported only where metrics are sent (it takes seconds)."""
    if not (info.is_main and job.mlflow_tracking_uri and job.mlflow_run_id):
        return NullLogger()
    from kiln.common.metrics import MetricLogger

    return MetricLogger(job.mlflow_tracking_uri, job.mlflow_run_id)


class Reporter(Protocol):
    def log(self, message: str) -> None: ...


class PrintReporter:
    def log(self, message: str) -> None:
        print(message, flush=True)


@dataclass
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def cuda_problem(nproc_per_node: int) -> str | None:
    """Why ``nproc_per_node`` ranks cannot each have a GPU on this machine, or None when they can."""
    if not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else "no usable NVIDIA driver or GPU"
        return (f"device is cuda but torch {torch.__version__} sees no GPU here ({build}): run on a GPU machine "
                "with a CUDA build of torch, or set training_plan.hardware.device to cpu (or auto)")
    n = torch.cuda.device_count()
    if nproc_per_node > n:
        return (f"{nproc_per_node} ranks per node need {nproc_per_node} GPUs but this machine has {n}: set "
                f"training_plan.hardware.nproc_per_node to at most {n}")
    return None


def setup_distributed(device: str, timeout_s: int) -> DistInfo:
    """Join the process group torchrun set up (gloo on CPU; nccl on CUDA, with gloo beside it for CPU-side
    collectives and background checkpoint saves); a hung collective fails after ``timeout_s``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        problem = cuda_problem(local_rank + 1)
        if problem:
            raise RuntimeError(f"rank {rank}: {problem}")
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if device == "cuda" else "gloo",
                                timeout=dt.timedelta(seconds=timeout_s))
    return DistInfo(rank, local_rank, world, dev)


def broadcast_config(cls, path: str | None, info: DistInfo):
    """Rank 0 reads the job file; every rank builds ``cls`` from the same dict (ranks never read config
    themselves; unknown keys are errors)."""
    payload = [None]
    if info.is_main:
        payload[0] = json.loads(Path(path).read_text()) if path else {}
    if info.world_size > 1:
        dist.broadcast_object_list(payload, src=0)
    return from_dict(cls, payload[0], "job")


def broadcast_job(path: str | None, info: DistInfo) -> JobConfig:
    """The pretraining job every rank agrees on (broadcast_config of JobConfig)."""
    return broadcast_config(JobConfig, path, info)


def lr_lambda(opt: OptimConfig, max_steps: int) -> Callable[[int], float]:
    """Linear warmup then cosine decay to min_lr_ratio, as a multiplier of the peak lr."""

    def f(step: int) -> float:
        if step < opt.warmup_steps:
            return (step + 1) / opt.warmup_steps
        progress = min(1.0, (step - opt.warmup_steps) / max(1, max_steps - opt.warmup_steps))
        return opt.min_lr_ratio + (1 - opt.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def make_optimizer(model: torch.nn.Module, opt: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with decay on matrices only; the fused kernel (one pass over all parameters) on CUDA and CPU."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=opt.lr, betas=(opt.beta1, opt.beta2), fused=device.type in ("cuda", "cpu"),
    )


def make_loaders(job: JobConfig, info: DistInfo, eot: int):
    """(train loader, function returning validation batches) for the job's task."""
    if job.task == "pretrain":
        from kiln.loader import TokenLoader, iter_eval_batches

        train = TokenLoader([Path(p) for p in job.train_files], job.micro_batch, job.seq_len,
                            info.rank, info.world_size, job.seed)
        val = lambda: iter_eval_batches([Path(p) for p in job.val_files], job.micro_batch, job.seq_len, job.eval_batches)  # noqa: E731
        return train, val
    if job.task == "sft":
        from kiln.posttrain.sft import PackedLoader, encode_example, iter_packed_eval, pack, read_pairs
        from kiln.tokenizer import load_encoding

        enc = load_encoding(job.tokenizer)

        def packed(split: str):
            rows = read_pairs(job.train_files[0], split)
            if not rows:
                raise ValueError(f"{job.train_files[0]}: no '{split}' instruction pairs")
            return pack((encode_example(enc, r["prompt"], r["response"]) for r in rows), job.seq_len, eot)

        tt, tm = packed("train")
        vt, vm = packed("val")
        train = PackedLoader(tt, tm, job.micro_batch, info.rank, info.world_size, job.seed)
        return train, lambda: iter_packed_eval(vt, vm, job.micro_batch, job.eval_batches)
    raise ValueError(f"job.task must be 'pretrain' or 'sft', not {job.task!r}")


def _proc_status_kib(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_memory_gb(device: torch.device, baseline_gb: float = 0.0) -> float:
    """Peak memory of training: CUDA's allocator peak; on CPU the process's peak resident memory above
    ``baseline_gb`` (the interpreter and libraries, measured before the model was built)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    hwm = _proc_status_kib("VmHWM")
    peak = hwm / 1024**2 if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    return max(0.0, peak - baseline_gb)


def resident_gb() -> float:
    rss = _proc_status_kib("VmRSS")
    return rss / 1024**2 if rss is not None else 0.0


def all_mean(value: float, info: DistInfo) -> float:
    if info.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=info.device if info.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return t.item() / info.world_size


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of (B, T) inputs against (B, T) targets (-100 skipped), through the
    model's chunked head (kiln.model.gpt.LinearCrossEntropy): the (B, T, V) logits never exist at once."""
    return model(x, y)


def accumulate_gradients(model: torch.nn.Module, loader, grad_accum: int, device: torch.device, autocast) -> float:
    """Forward and backward ``grad_accum`` micro-batches from ``loader`` (gradients synchronised across ranks on
    the last only); return this rank's mean loss. One sync with the device per step, for the returned number."""
    loss_sum = torch.zeros((), device=device)
    for micro in range(grad_accum):
        x, y = loader.next_batch()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with gradient_sync(model, micro == grad_accum - 1), autocast():
            loss = lm_loss(model, x, y)
        (loss / grad_accum).backward()
        loss_sum += loss.detach()
    return loss_sum.item() / grad_accum


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, info: DistInfo, autocast) -> float:
    """Mean token cross-entropy over the validation batches (targets equal to -100 are skipped)."""
    model.eval()
    total, count = 0.0, 0
    for x, y in batches():
        x, y = x.to(info.device), y.to(info.device)
        with autocast():
            logits = model(x)  # (B, T, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-100, reduction="sum")
        total += loss.item()
        count += int((y != -100).sum())
    model.train()
    if info.world_size > 1:
        t = torch.tensor([total, count], dtype=torch.float64)
        dist.all_reduce(t)
        total, count = t.tolist()
    return total / max(count, 1)


def resolve_peak_flops(job: JobConfig, device: torch.device) -> float:
    """Per-device peak FLOP/s for MFU: the job's, the GPU table's, or a matmul measured now on CPU (0: none)."""
    from kiln.plan import gpu_peak_tflops, measure_matmul_peak

    if job.peak_flops != 0:
        return max(job.peak_flops, 0.0)
    if device.type == "cuda":
        return (gpu_peak_tflops(torch.cuda.get_device_name(device)) or 0.0) * 1e12
    return measure_matmul_peak("cpu")


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


@dataclass
class RunState:
    """Training-loop bookkeeping saved in every checkpoint beside model, optimizer, scheduler and loader."""

    step: int = 0  # optimizer steps whose updates are in the weights
    data_batches: int = 0  # global batches drawn from the loader (steps plus batches skipped after spikes)
    lineage_s: float = 0.0  # seconds of the steps that made these weights (goodput's productive time)
    train_loss: float = float("nan")
    val_loss: float | None = None
    history: list = field(default_factory=list)  # {step, train_loss, val_loss} at every validation
    curve: list = field(default_factory=list)  # [step, train_loss] at every progress line (the loss plot)


def train(job: JobConfig, info: DistInfo, reporter: Reporter) -> dict[str, Any]:
    """Run the job to max_steps, resuming from the newest good checkpoint in out_dir; return the summary."""
    out = Path(job.out_dir)
    cfg = from_dict(GPTConfig, job.model, "job.model")
    opt_cfg = from_dict(OptimConfig, job.optim, "job.optim")
    spike_cfg = from_dict(SpikeConfig, job.spikes, "job.spikes")
    strategy = "none" if info.world_size == 1 else ("ddp" if job.parallelism == "auto" else job.parallelism)
    out.mkdir(parents=True, exist_ok=True)  # fail_at_step's marker may be written before any checkpoint
    ledger = GoodputLedger(out / "goodput.jsonl", info.is_main)
    base_gb = resident_gb()

    def say(message: str) -> None:  # rank 0 alone reports
        if info.is_main:
            reporter.log(message)

    def warn(message: str) -> None:
        if info.is_main:
            getattr(reporter, "warning", reporter.log)(message)

    torch.manual_seed(job.seed)  # identical initial weights on every rank
    raw_model = GPT(cfg).to(info.device)
    bf16 = info.device.type == "cuda" and torch.cuda.is_bf16_supported()
    model = parallelize(raw_model, strategy, job.activation_checkpointing, job.compile, info.device, bf16)
    optimizer = make_optimizer(raw_model, opt_cfg, info.device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(opt_cfg, job.max_steps))
    from kiln.tokenizer import load_encoding

    eot = load_encoding(job.tokenizer).eot_token
    loader, val_batches = make_loaders(job, info, eot)
    logger = make_logger(job, info)
    ckpt = Checkpointer(out / "checkpoints", info.rank, info.world_size, sharded=strategy == "fsdp",
                        async_save=job.async_save, keep_last=job.keep_last, keep_every=job.keep_every,
                        extra_files={"tokenizer.json": Path(job.tokenizer)}, log=say, pause_s=job.save_pause_s)
    detector = SpikeDetector(spike_cfg)
    run = RunState()
    events: list[dict[str, Any]] = []  # rollbacks of this job, across restarts (also saved in checkpoints)
    # with FSDP2's mixed precision the sharded parameters are cast to bf16 already; otherwise autocast on CUDA
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if (bf16 and strategy != "fsdp") else contextlib.nullcontext

    def restore(path: Path, rolling_back: bool = False) -> None:
        nonlocal run, events
        extras, _ = ckpt.load(path, raw_model, optimizer)
        scheduler.load_state_dict(extras["scheduler"])
        loader.load_state_dict(extras["loader"])
        rngs = extras["rng"]
        if info.rank < len(rngs):
            set_rng_state(rngs[info.rank])
        else:  # resumed on more ranks than saved: new ranks get their own stream
            torch.manual_seed(job.seed + info.rank + 1_000_003 * extras["step"])
        detector.load_state_dict(extras["spikes"])
        run = RunState(**extras["run"])
        if not rolling_back:  # a rollback keeps the events that led to it
            events = list(extras.get("events", []))

    latest = ckpt.latest()
    resumed_from = None
    if latest is not None:
        restore(latest)
        resumed_from = str(latest)
        say(f"resumed from {latest} at step {run.step}")
    elif job.init_from:
        src = ckpt.agree(lambda: str(resolve_checkpoint(job.init_from)))
        ckpt.load(Path(src), raw_model, None)
        say(f"initialised weights from {src}")
    if latest is None:  # weights above are identical on every rank; dropout must differ per rank
        torch.manual_seed(job.seed + info.rank)

    fpt = flops_per_token(cfg, job.seq_len)
    tokens_per_step = job.micro_batch * job.seq_len * job.grad_accum * info.world_size
    peak_flops = resolve_peak_flops(job, info.device)
    if info.is_main:
        logger.log_params({"job": {k: v for k, v in asdict(job).items() if k not in ("train_files", "val_files")},
                           "peak_flops_per_device": peak_flops})
        say(f"training {raw_model.num_params() / 1e6:.2f}M parameters on {info.world_size} x {info.device.type} "
            f"({describe(strategy, job.activation_checkpointing, job.compile)}), {tokens_per_step} tokens/step, "
            f"steps {run.step}->{job.max_steps}"
            + (f", MFU against {peak_flops / 1e12:.3g} TFLOP/s per device" if peak_flops else ""))

    def save(step_now: int) -> None:
        rngs: list[Any] = [None] * info.world_size
        if info.world_size > 1:
            dist.all_gather_object(rngs, rng_state())
        else:
            rngs = [rng_state()]
        extras = {"scheduler": scheduler.state_dict(), "loader": loader.state_dict(), "rng": rngs, "step": step_now,
                  "spikes": detector.state_dict(), "run": asdict(run), "events": events}
        meta = {"model": asdict(cfg), "task": job.task, "val_loss": run.val_loss, "train_loss": run.train_loss,
                "seed": job.seed, "world_size": info.world_size, "parallelism": strategy, "history": run.history,
                "job": {k: v for k, v in asdict(job).items() if k not in ("train_files", "val_files")}}
        ledger.add("save_s", ckpt.save(step_now, raw_model, optimizer, extras, meta))

    def rollback(reason: str, loss: float) -> None:
        """PaLM's recipe: back to a checkpoint about rollback_steps earlier, then skip the batches around the spike."""
        nonlocal skipped_in_a_row
        n_rollbacks = sum(1 for e in events if e["event"] == "rollback")
        if n_rollbacks >= spike_cfg.max_rollbacks or skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
            why = (f"after {n_rollbacks} rollbacks (spikes.max_rollbacks={spike_cfg.max_rollbacks})"
                   if n_rollbacks >= spike_cfg.max_rollbacks else
                   f"after {skipped_in_a_row} updates in a row were dropped, with no checkpoint yet to roll back to")
            raise SpikeError(f"loss spike at step {run.step + 1} ({reason}) {why}: lower optim.lr, raise "
                             f"optim.warmup_steps or check the data near batch {run.data_batches}")
        t0 = time.perf_counter()
        ledger.add("save_s", ckpt.wait())
        spike_step, spike_batches = run.step + 1, run.data_batches
        target = ckpt.latest(before_step=spike_step - spike_cfg.rollback_steps) or ckpt.latest(before_step=run.step)
        if target is None:  # too early for any checkpoint: drop this batch's update (a run of them means trouble)
            warn(f"loss spike at step {spike_step}: {reason}; no checkpoint to roll back to, so this update is skipped")
            events.append({"event": "skipped_update", "step": spike_step, "reason": reason, "loss": loss})
            logger.log({"spike": 1.0}, spike_step)
            skipped_in_a_row += 1
            return
        restore(target, rolling_back=True)
        if info.is_main:  # checkpoints after the target belong to the abandoned trajectory
            for p in list_checkpoints(ckpt.root):
                if step_of(p) > run.step:
                    shutil.rmtree(p, ignore_errors=True)
        skip = max(spike_cfg.skip_batches, spike_batches - run.data_batches)
        for _ in range(skip * job.grad_accum):
            loader.next_batch()
        run.data_batches += skip
        event = {"event": "rollback", "step": spike_step, "to_step": run.step, "skipped_batches": skip,
                 "reason": reason, "loss": loss}
        events.append(event)
        ledger.add("restore_s", time.perf_counter() - t0)
        ledger.restored(run.step, run.lineage_s)
        logger.log({"spike": 1.0, "spike_loss": loss, "rollback_to_step": float(run.step), "skipped_batches": float(skip)},
                   spike_step)
        warn(f"loss spike at step {spike_step}: {reason}. Rolled back to step {run.step} ({target.name}) and skipped "
             f"{skip} batches ({n_rollbacks + 1}/{spike_cfg.max_rollbacks} rollbacks)")

    t_start = time.time()
    ledger.ready(run.step, run.lineage_s)
    first_val = None
    if run.step == 0 and not run.history:
        t0 = time.perf_counter()
        first_val = evaluate(model, val_batches, info, autocast)
        ledger.add("eval_s", time.perf_counter() - t0)
        run.val_loss = first_val
        run.history.append({"step": 0, "val_loss": first_val})
        logger.log({"val_loss": first_val}, 0)
        say(f"step 0: val loss {first_val:.4f}")
    session_steps, session_tokens_s, mfus, grad_spikes, skipped_in_a_row = 0, [], [], 0, 0
    t_ready = time.perf_counter()
    inject_batch = int(job.inject_spike.get("batch", -1)) if job.inject_spike else -1
    model.train()
    while run.step < job.max_steps:
        t0 = time.perf_counter()
        poisoned = run.data_batches == inject_batch
        loss_mean = accumulate_gradients(model, loader, job.grad_accum, info.device, autocast)
        run.data_batches += 1
        norm = clip_grad_norm(model, opt_cfg.grad_clip)
        train_loss = all_mean(loss_mean, info)
        verdict = detector.check(train_loss, norm)
        if detector.rolls_back(verdict):
            optimizer.zero_grad(set_to_none=True)
            ledger.add("step_s", time.perf_counter() - t0)
            rollback(verdict[1], train_loss)
            continue
        skipped_in_a_row = 0
        if verdict is not None:  # a gradient-norm spike: clipped, reported, trained on
            grad_spikes += 1
            logger.log({"grad_norm_spike": norm}, run.step + 1)
            warn(f"step {run.step + 1}: {verdict[1]} (clipped to {opt_cfg.grad_clip}; a rollback follows only if the loss spikes)")
        factor = float(job.inject_spike.get("lr_factor", 1.0)) if poisoned else 1.0
        for g in optimizer.param_groups:
            g["lr"] *= factor
        optimizer.step()
        for g in optimizer.param_groups:
            g["lr"] /= factor
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        run.step += 1
        run.train_loss = train_loss
        step = run.step
        dt_step = time.perf_counter() - t0
        ledger.add("step_s", dt_step)
        run.lineage_s = ledger.lineage_s
        if step == job.fail_at_step and not (out / ".failed_once").exists():
            if info.is_main:
                (out / ".failed_once").write_text(str(step))
            raise RuntimeError(f"injected failure at step {step} (fail_at_step)")
        if step in job.kill_at_steps and info.is_main and not (out / f".killed_at_{step}").exists():
            (out / f".killed_at_{step}").write_text(str(step))
            os.kill(os.getpid(), signal.SIGKILL)
        session_steps += 1
        tok_s = tokens_per_step / dt_step
        session_tokens_s.append(tok_s)
        metrics = {"train_loss": train_loss, "lr": scheduler.get_last_lr()[0], "grad_norm": norm,
                   "tokens_per_s": tok_s, "step_time_s": dt_step, "memory_gb": peak_memory_gb(info.device, base_gb)}
        if peak_flops > 0:
            metrics["mfu"] = fpt * tok_s / (peak_flops * info.world_size)
            mfus.append(metrics["mfu"])
        logger.log(metrics, step)
        if step % job.eval_interval == 0 or step == job.max_steps:
            t1 = time.perf_counter()
            run.val_loss = evaluate(model, val_batches, info, autocast)
            ledger.add("eval_s", time.perf_counter() - t1)
            run.history.append({"step": step, "train_loss": train_loss, "val_loss": run.val_loss})
            logger.log({"val_loss": run.val_loss}, step)
        if step % job.log_interval == 0 or step == job.max_steps:
            run.curve.append([step, train_loss])
            if info.is_main:
                left = (time.perf_counter() - t_ready) / session_steps * (job.max_steps - step)
                val = run.val_loss if run.val_loss is not None else float("nan")
                mfu = f" | MFU {metrics['mfu']:.1%}" if "mfu" in metrics else ""
                reporter.log(
                    f"step {step}/{job.max_steps}: loss {train_loss:.4f} | val {val:.4f} | lr {metrics['lr']:.2e} | "
                    f"grad_norm {norm:.2f} | {tok_s:,.0f} tok/s{mfu} | {metrics['memory_gb']:.2f} GiB | "
                    f"{format_duration(left)} left")
        if step % job.ckpt_interval == 0 or step == job.max_steps:
            save(step)
        ledger.beat(step)
    ledger.add("save_s", ckpt.wait())
    logger.flush()
    digests = _rank_digests(model, info)
    if info.is_main and len(set(digests)) > 1:
        warn(f"ranks disagree on the final parameters: {digests}")
    ledger.beat(run.step, event="end")
    goodput = summarize(out / "goodput.jsonl") if info.is_main else {}
    if info.is_main:
        logger.log({f"goodput_{k}" if k != "goodput" else k: v for k, v in goodput.items()
                    if isinstance(v, (int, float))}, run.step)
        logger.flush()
    checkpoints = _checkpoint_table(ckpt.root) if info.is_main else []
    summary = {
        "task": job.task,
        "steps": run.step,
        "tokens": run.step * tokens_per_step,
        "final_train_loss": run.train_loss,
        "final_val_loss": run.val_loss,
        "initial_val_loss": run.history[0].get("val_loss") if run.history else first_val,
        "history": run.history,
        "curve": run.curve,
        "checkpoint": checkpoints[-1]["path"] if checkpoints else None,
        "checkpoints": checkpoints,
        "resumed_from": resumed_from,
        "world_size": info.world_size,
        "device": info.device.type,
        "parallelism": strategy,
        "activation_checkpointing": job.activation_checkpointing,
        "compile": job.compile,
        "params": raw_model.num_params(),
        "wall_s": time.time() - t_start,
        "tokens_per_s": sorted(session_tokens_s)[len(session_tokens_s) // 2] if session_tokens_s else None,
        "mfu": sorted(mfus)[len(mfus) // 2] if mfus else None,
        "peak_flops_per_device": peak_flops,
        "peak_memory_gb": peak_memory_gb(info.device, base_gb),
        "data_batches": run.data_batches,
        "events": events,
        "grad_norm_spikes": grad_spikes,
        "goodput": goodput,
        "rank_param_digests": digests,
    }
    if info.is_main:
        atomic_write_json(out / "result.json", summary)
    return summary


def _rank_digests(model: torch.nn.Module, info: DistInfo) -> list[str]:
    """Every rank's digest of the full parameters (replicas must agree; FSDP2 gathers each in turn)."""
    mine = param_digest(model)
    if info.world_size == 1:
        return [mine]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, mine)
    return out


def _checkpoint_table(root: Path) -> list[dict[str, Any]]:
    rows = []
    for p in list_checkpoints(root):
        meta = json.loads((p / "meta.json").read_text())
        rows.append({"step": meta["step"], "path": str(p), "val_loss": meta.get("val_loss"), "format": meta.get("format"),
                     "bytes": sum(f.stat().st_size for f in p.rglob("*") if f.is_file())})
    return rows


def main(argv: list[str] | None = None, reporter: Reporter | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="job JSON file (JobConfig fields), read by rank 0")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (the same on every rank)")
    parser.add_argument("--timeout-s", type=int, default=600, help="process-group timeout in seconds")
    args = parser.parse_args(argv)
    reporter = reporter or PrintReporter()
    info = setup_distributed(args.device, args.timeout_s)
    try:
        job = broadcast_job(args.config, info)
        return train(job, info, reporter)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
