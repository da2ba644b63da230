"""The training job: pretraining on token shards or supervised fine-tuning, on one or many processes.

One process:   python -m kiln.train --config job.json
Several:       python -m torch.distributed.run --nproc_per_node=2 -m kiln.train --config job.json
Several nodes: torchrun --nnodes=2 --node_rank=R --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT -m kiln.train ...
Rank 0 reads the job file and broadcasts it, so every rank trains with the same settings.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from kiln.checkpoint import latest_good_checkpoint, load_state, resolve_checkpoint, rng_state, save_checkpoint, set_rng_state
from kiln.config import from_dict
from kiln.model import GPT, GPTConfig
from kiln.storage import atomic_write_json
from kiln.tracking import MetricLogger


@dataclass
class OptimConfig:
    lr: float = 2e-3  # peak learning rate after warmup
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at max_steps
    warmup_steps: int = 50  # linear warmup from 0 to lr
    weight_decay: float = 0.1  # AdamW decay on matrices (not on biases, norms)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # clip the global gradient norm to this (0 disables)


@dataclass
class JobConfig:
    task: str = "pretrain"  # "pretrain" on token shards or "sft" on instruction pairs
    out_dir: str = ""  # run folder: checkpoints/, result.json, metrics.jsonl
    tokenizer: str = ""  # tokenizer.json copied into every checkpoint
    model: dict = field(default_factory=dict)  # GPTConfig fields
    optim: dict = field(default_factory=dict)  # OptimConfig fields
    train_files: list = field(default_factory=list)  # token shards (pretrain) or one instruction JSONL (sft)
    val_files: list = field(default_factory=list)  # validation shards; for sft the same JSONL (split=val)
    seq_len: int = 256  # tokens per sequence
    micro_batch: int = 8  # sequences per rank per forward
    grad_accum: int = 1  # micro-batches per optimizer step
    max_steps: int = 100  # optimizer steps
    eval_interval: int = 50  # steps between validation passes
    eval_batches: int = 8  # micro-batches per validation pass
    ckpt_interval: int = 100  # steps between checkpoints (the last step is always saved)
    keep_last: int = 2  # checkpoints kept on disk
    log_interval: int = 10  # steps between progress lines
    seed: int = 1337  # seeds init, data order and dropout
    init_from: str = ""  # checkpoint whose weights start this run (fine-tuning)
    mlflow_tracking_uri: str = ""  # where rank 0 streams metrics
    mlflow_run_id: str = ""  # the MLflow run that receives them
    peak_flops: float = 0.0  # per-device peak FLOP/s for MFU (0 omits MFU)
    fail_at_step: int = -1  # testing aid: raise at this step once (simulates a crash)


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


def setup_distributed(device: str, timeout_s: int) -> DistInfo:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device == "cuda" else "gloo", timeout=dt.timedelta(seconds=timeout_s)
        )
    return DistInfo(rank, local_rank, world, dev)


def broadcast_job(path: str | None, info: DistInfo) -> JobConfig:
    """Rank 0 reads the job file; every rank receives the same dict (ranks never read config themselves)."""
    payload = [None]
    if info.is_main:
        payload[0] = json.loads(Path(path).read_text()) if path else {}
    if info.world_size > 1:
        dist.broadcast_object_list(payload, src=0)
    return from_dict(JobConfig, payload[0], "job")


def lr_lambda(opt: OptimConfig, max_steps: int) -> Callable[[int], float]:
    """Linear warmup then cosine decay to min_lr_ratio, as a multiplier of the peak lr."""

    def f(step: int) -> float:
        if step < opt.warmup_steps:
            return (step + 1) / opt.warmup_steps
        progress = min(1.0, (step - opt.warmup_steps) / max(1, max_steps - opt.warmup_steps))
        return opt.min_lr_ratio + (1 - opt.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def make_optimizer(model: torch.nn.Module, opt: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=opt.lr, betas=(opt.beta1, opt.beta2), fused=device.type == "cuda",
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
        from kiln.sft import PackedLoader, encode_example, iter_packed_eval, pack, read_pairs
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


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # Linux reports KiB


def all_mean(value: float, info: DistInfo) -> float:
    if info.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=info.device if info.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return t.item() / info.world_size


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


def train(job: JobConfig, info: DistInfo, reporter: Reporter) -> dict[str, Any]:
    """Run the job to max_steps, resuming from the newest good checkpoint in out_dir; return the summary."""
    out = Path(job.out_dir)
    ckpt_root = out / "checkpoints"
    cfg = from_dict(GPTConfig, job.model, "job.model")
    opt_cfg = from_dict(OptimConfig, job.optim, "job.optim")
    out.mkdir(parents=True, exist_ok=True)  # fail_at_step's marker may be written before any checkpoint
    torch.manual_seed(job.seed)  # identical initial weights on every rank
    model = GPT(cfg).to(info.device)
    optimizer = make_optimizer(model, opt_cfg, info.device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(opt_cfg, job.max_steps))
    from kiln.tokenizer import load_encoding

    eot = load_encoding(job.tokenizer).eot_token
    loader, val_batches = make_loaders(job, info, eot)
    logger = MetricLogger(job.mlflow_tracking_uri, job.mlflow_run_id if info.is_main else None)

    def say(message: str) -> None:  # rank 0 alone reports
        if info.is_main:
            reporter.log(message)

    step, resumed_from, history = 0, None, []
    latest = latest_good_checkpoint(ckpt_root, log=say)
    if latest is not None:
        state, meta = load_state(latest, "cpu")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        loader.load_state_dict(state["loader"])
        rngs = state["rng"]
        set_rng_state(rngs[info.rank] if info.rank < len(rngs) else rngs[0])
        step, resumed_from, history = state["step"], str(latest), meta.get("history", [])
        say(f"resumed from {latest} at step {step}")
    elif job.init_from:
        src = resolve_checkpoint(job.init_from)
        state, _ = load_state(src, "cpu")
        model.load_state_dict(state["model"])
        say(f"initialised weights from {src}")
    if latest is None:  # weights above are identical on every rank; dropout must differ per rank
        torch.manual_seed(job.seed + info.rank)

    raw_model = model
    if info.world_size > 1:
        model = DDP(model, device_ids=[info.local_rank] if info.device.type == "cuda" else None)
    use_bf16 = info.device.type == "cuda" and torch.cuda.is_bf16_supported()
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext

    from kiln.model import flops_per_token

    fpt = flops_per_token(cfg, job.seq_len)
    tokens_per_step = job.micro_batch * job.seq_len * job.grad_accum * info.world_size
    if info.is_main:
        logger.log_params({"job": {k: v for k, v in asdict(job).items() if k not in ("train_files", "val_files")}})
        reporter.log(
            f"training {raw_model.num_params() / 1e6:.2f}M parameters on {info.world_size} x {info.device.type}, "
            f"{tokens_per_step} tokens/step, steps {step}->{job.max_steps}"
        )

    def save(step_now: int, val_loss: float | None) -> Path | None:
        rngs = [None] * info.world_size
        if info.world_size > 1:
            dist.all_gather_object(rngs, rng_state())
        else:
            rngs = [rng_state()]
        path = None
        if info.is_main:
            state = {
                "model": raw_model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "loader": loader.state_dict(),
                "rng": rngs,
                "step": step_now,
            }
            meta = {"model": asdict(cfg), "task": job.task, "val_loss": val_loss, "seed": job.seed,
                    "world_size": info.world_size, "history": history}
            path = save_checkpoint(ckpt_root, step_now, state, meta, {"tokenizer.json": Path(job.tokenizer)},
                                   keep_last=job.keep_last)
        if info.world_size > 1:
            dist.barrier()
        return path

    t_start = time.time()
    first_val = None
    if step == 0:
        first_val = evaluate(model, val_batches, info, autocast)
        history.append({"step": 0, "val_loss": first_val})
        logger.log({"val_loss": first_val}, 0)
        say(f"step 0: val loss {first_val:.4f}")
    # a resumed run carries its last losses on (a rerun of a finished job must not report them as missing)
    last = history[-1] if history else {}
    train_loss = last.get("train_loss", float("nan")) if resumed_from else float("nan")
    val_loss = first_val if first_val is not None else last.get("val_loss")
    last_ckpt = None
    model.train()
    while step < job.max_steps:
        t0 = time.time()
        loss_acc = 0.0
        for micro in range(job.grad_accum):
            x, y = loader.next_batch()
            x, y = x.to(info.device), y.to(info.device)
            sync = contextlib.nullcontext if (info.world_size == 1 or micro == job.grad_accum - 1) else model.no_sync
            with sync(), autocast():
                logits = model(x)  # (B, T, V)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-100)
            (loss / job.grad_accum).backward()
            loss_acc += loss.item() / job.grad_accum
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.grad_clip if opt_cfg.grad_clip > 0 else float("inf"))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step == job.fail_at_step and not (out / ".failed_once").exists():
            if info.is_main:
                (out / ".failed_once").write_text(str(step))
            raise RuntimeError(f"injected failure at step {step} (fail_at_step)")
        dt_step = time.time() - t0
        train_loss = all_mean(loss_acc, info)
        tok_s = tokens_per_step / dt_step
        metrics = {"train_loss": train_loss, "lr": scheduler.get_last_lr()[0], "grad_norm": float(norm),
                   "tokens_per_s": tok_s, "memory_gb": peak_memory_gb(info.device)}
        if job.peak_flops > 0:
            metrics["mfu"] = fpt * tok_s / (job.peak_flops * info.world_size)
        logger.log(metrics, step)
        if step % job.eval_interval == 0 or step == job.max_steps:
            val_loss = evaluate(model, val_batches, info, autocast)
            history.append({"step": step, "train_loss": train_loss, "val_loss": val_loss})
            logger.log({"val_loss": val_loss}, step)
        if info.is_main and (step % job.log_interval == 0 or step == job.max_steps):
            reporter.log(
                f"step {step}/{job.max_steps}: loss {train_loss:.4f} val {val_loss if val_loss is not None else float('nan'):.4f} "
                f"lr {metrics['lr']:.2e} grad_norm {metrics['grad_norm']:.2f} {tok_s:,.0f} tok/s"
            )
        if step % job.ckpt_interval == 0 or step == job.max_steps:
            last_ckpt = save(step, val_loss)
    logger.flush()
    summary = {
        "task": job.task,
        "steps": step,
        "tokens": step * tokens_per_step,
        "final_train_loss": train_loss,
        "final_val_loss": val_loss,
        "initial_val_loss": history[0].get("val_loss") if history else first_val,
        "history": history,
        "checkpoint": str(last_ckpt or latest_good_checkpoint(ckpt_root)),
        "resumed_from": resumed_from,
        "world_size": info.world_size,
        "device": info.device.type,
        "params": raw_model.num_params(),
        "wall_s": time.time() - t_start,
    }
    if info.is_main:
        atomic_write_json(out / "result.json", summary)
    return summary


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
