"""Benchmark: the Trainer's training step (tokens/s, achieved FLOP/s, MFU) against a matmul peak measured in the same run.

CPU (the issue's setting): python bench/bench_train.py            # 4 layers x 4 heads x 128 wide, T=64, B=12, fp32, 2 threads
GPU (bench/gpu.sh):        python bench/bench_train.py --device cuda --preset gpt2 --seq-len 1024 --micro-batch 16 --steps 100
The step is Kiln's own (kiln.train.trainer.accumulate_gradients, clipping, fused AdamW, the cosine schedule) on random
tokens, so data loading is not measured. FLOPs per token are PaLM's 6N + 12 L C T (kiln.model.families.flops_per_token).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kiln.model.config import ModelConfig, preset_fields  # noqa: E402
from kiln.model.families import build_model, flops_per_token  # noqa: E402
from kiln.model.parallel import clip_grad_norm, parallelize  # noqa: E402
from kiln.plan.memory import gpu_peak_tflops, measure_matmul_peak  # noqa: E402
from kiln.train.optim import OptimConfig, lr_lambda, make_optimizer  # noqa: E402
from kiln.train.trainer import accumulate_gradients  # noqa: E402
from provenance import header  # noqa: E402


class RandomTokens:
    """A loader of uniform random tokens: (B, T) inputs and targets, made on the device."""

    def __init__(self, vocab: int, batch: int, seq_len: int, device: torch.device):
        self.g = torch.Generator(device=device).manual_seed(0)
        self.shape, self.vocab, self.device = (batch, seq_len + 1), vocab, device

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randint(0, self.vocab, self.shape, generator=self.g, device=self.device)  # (B, T+1)
        return w[:, :-1], w[:, 1:]


def matmul_peak(device: str, seconds: float) -> tuple[float, int]:
    """(best FLOP/s, size) over square matmuls of a few sizes: the yardstick for MFU on this machine."""
    sizes = (1024, 2048, 4096) if device == "cuda" else (512, 1024, 2048)
    results = [(measure_matmul_peak(device, seconds=seconds, n=n), n) for n in sizes]
    return max(results)


def gemm_ceiling(cfg: ModelConfig, tokens: int, device: torch.device, reps: int = 5) -> float:
    """FLOP/s of the model's own matrix products alone (every Linear's forward, input-gradient and weight-gradient
    GEMM, best of ``reps`` each): what a step could reach if everything else cost nothing."""
    c, v = cfg.n_embd, cfg.vocab_size
    if cfg.family == "llama":
        kv, i = cfg.n_kv_head * cfg.head_dim, cfg.intermediate_size
        block = [(c, c), (c, kv), (c, kv), (c, c), (c, i), (c, i), (i, c)]  # q, k, v, o, gate, up, down
    else:
        block = [(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c)]
    shapes = block * cfg.n_layer + [(c, v)]  # (in, out) of each Linear
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    flops = seconds = 0.0
    for k, n in shapes:
        for a_shape, b_shape in (((tokens, k), (k, n)), ((tokens, n), (n, k)), ((k, tokens), (tokens, n))):
            a = torch.randn(a_shape, device=device, dtype=dtype)
            b = torch.randn(b_shape, device=device, dtype=dtype)
            best = float("inf")
            for _ in range(reps):
                sync()
                t0 = time.perf_counter()
                a @ b
                sync()
                best = min(best, time.perf_counter() - t0)
            flops += 2 * a_shape[0] * a_shape[1] * b_shape[1]
            seconds += best
    return flops / seconds


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="", help="named model size of --family (kiln.model.config.MODEL_PRESETS); default 4x4x128")
    p.add_argument("--family", default="gpt2", help="model family: gpt2 or llama")
    p.add_argument("--vocab", type=int, default=8192, help="padded vocabulary (8192: the demo tokenizer; 50304 for GPT-2)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=12)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=40, help="timed steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="torch.compile each block (kiln.model.parallel.apply_compile)")
    p.add_argument("--peak-seconds", type=float, default=1.0, help="time spent per matmul size measuring the peak")
    p.add_argument("--json", default="", help="also write the results to this file")
    a = p.parse_args(argv)

    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    fields = preset_fields(a.preset, a.family) if a.preset else dict(n_layer=4, n_head=4, n_embd=128, block_size=64)
    fields["family"] = a.family
    fields["block_size"] = max(fields["block_size"], a.seq_len)
    cfg = ModelConfig(vocab_size=a.vocab, **fields)
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    step_model = parallelize(model, "none", False, a.compile, device)
    opt_cfg = OptimConfig(lr=6e-4, warmup_steps=10)
    optimizer = make_optimizer(model, opt_cfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(opt_cfg, a.warmup + a.steps))
    loader = RandomTokens(a.vocab, a.micro_batch, a.seq_len, device)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def lm_loss(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        with autocast():
            return step_model(*batch), {}  # the chunked head's mean cross-entropy

    def step() -> float:
        t0 = time.perf_counter()
        batches = (loader.next_batch() for _ in range(a.grad_accum))
        accumulate_gradients(step_model, batches, lm_loss, a.grad_accum, device)  # syncs for the loss
        clip_grad_norm(step_model, opt_cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t0

    t_compile = time.perf_counter()
    for _ in range(a.warmup):
        step()
    warmup_s = time.perf_counter() - t_compile
    times = [step() for _ in range(a.steps)]
    peak, peak_n = 0.0, 0
    if device.type == "cuda":
        peak = (gpu_peak_tflops(torch.cuda.get_device_name(device)) or 0) * 1e12
    measured_peak, measured_n = matmul_peak(a.device, a.peak_seconds)
    if not peak:
        peak, peak_n = measured_peak, measured_n
    tokens = a.micro_batch * a.seq_len * a.grad_accum
    fpt = flops_per_token(cfg, a.seq_len)
    ceiling = gemm_ceiling(cfg, a.micro_batch * a.seq_len, device)
    median, best = statistics.median(times), min(times)
    out = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x {a.threads} threads",
        "model": {**fields, "vocab_size": a.vocab, "params": model.num_params(non_embedding=False)},
        "dtype": "bf16 autocast" if bf16 else "fp32", "compile": a.compile, "micro_batch": a.micro_batch,
        "seq_len": a.seq_len, "grad_accum": a.grad_accum, "steps": a.steps, "warmup_s": round(warmup_s, 2),
        "step_ms_median": round(median * 1e3, 2), "step_ms_best": round(best * 1e3, 2),
        "tokens_per_s": round(tokens / median), "flops_per_token": fpt,
        "achieved_tflops": fpt * tokens / median / 1e12,
        "matmul_peak_tflops_measured": measured_peak / 1e12, "matmul_peak_size": measured_n,
        "peak_tflops_used": peak / 1e12, "peak_source": "measured matmul" if peak_n else "GPU data sheet (dense bf16)",
        "mfu_median_step": fpt * tokens / median / peak, "mfu_best_step": fpt * tokens / best / peak,
        "gemm_ceiling_tflops": ceiling / 1e12, "gemm_ceiling_vs_peak": ceiling / peak,
        "step_vs_gemm_ceiling": fpt * tokens / median / ceiling,
    }
    if device.type == "cuda":
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1024**3
        out["mfu_vs_measured_matmul"] = fpt * tokens / median / measured_peak
    print(f"{out['device']}: {cfg.n_layer}L x {cfg.n_head}H x {cfg.n_embd}, V={a.vocab}, T={a.seq_len}, B={a.micro_batch}"
          f"x{a.grad_accum}, {out['dtype']}{', compiled' if a.compile else ''}")
    print(f"  step {out['step_ms_median']:.1f} ms median ({out['step_ms_best']:.1f} best), "
          f"{out['tokens_per_s']:,} tokens/s, {out['achieved_tflops'] * 1e3:.1f} GFLOP/s achieved")
    print(f"  matmul peak measured in this run: {measured_peak / 1e9:.1f} GFLOP/s (n={measured_n})")
    print(f"  MFU against {out['peak_source']} {peak / 1e12:.4g} TFLOP/s: {out['mfu_median_step']:.1%} (median step), "
          f"{out['mfu_best_step']:.1%} (best step)")
    print(f"  the model's own GEMMs alone run at {ceiling / 1e9:.1f} GFLOP/s = {out['gemm_ceiling_vs_peak']:.1%} of that peak; "
          f"the whole step reaches {out['step_vs_gemm_ceiling']:.1%} of them")
    if a.json:
        Path(a.json).write_text(json.dumps({**header(), **out}, indent=2))
    return out


if __name__ == "__main__":
    main()
