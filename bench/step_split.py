"""Benchmark, side by side in one run: where a training step's time goes in Kiln's demo model and in nanoGPT at the
demo's shape (8 x 256 tokens), phase by phase: forward and backward, gradient clipping, the optimizer step.

python bench/step_split.py [--steps 20] [--vocab 4096] [--out bench/results/STEM]

Kiln: the demo's llama (4 x 256, SwiGLU 704 wide, tied 4096-token head, the chunked loss) under the precision the
demo's plan picks on this CPU (bf16 autocast where it multiplies bf16 natively, else fp32), MuonAdamW as the demo
builds it (Newton-Schulz in ``ns_dtype``'s dtype). nanoGPT: its GPT-2 at the demo's shape as bench/bench_nanogpt.py
writes it, with its AdamW (weight decay on matrices) and its clipping at 1.0. Both train on the same random tokens,
one step each in turn, so both see the same machine. Reported: the median ms of each phase, each side's step, the
tokens/s ratio, and Kiln's step without its optimizer against nanoGPT's whole step (how far the optimizer alone
takes Kiln below nanoGPT's speed). To measure the AVX2 path on an AVX-512 CPU, run under ATEN_CPU_CAPABILITY=avx2
MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 (the machine line then says so).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import kiln.train.optim as optim  # noqa: E402
from bench_nanogpt import NANOGPT, nanogpt_model, nanogpt_optimizer  # noqa: E402
from muon_batches import demo_bench_args, demo_model  # noqa: E402
from provenance import write_results  # noqa: E402

PHASES = ("forward + backward", "clip", "optimizer")


def kiln_side(vocab: int, bf16: bool):
    model = demo_model(vocab)
    opt = optim.make_optimizer(model, optim.OptimConfig(**optim.PRETRAIN_OPTIM), torch.device("cpu"))

    def forward_backward(x: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(x[:, :-1], x[:, 1:])
        loss.backward()

    return model, opt, forward_backward


def nanogpt_side(vocab: int):
    torch.manual_seed(0)
    model = nanogpt_model(vocab, NANOGPT)
    opt = nanogpt_optimizer(model, NANOGPT)

    def forward_backward(x: torch.Tensor) -> None:
        logits = model(x[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1)).backward()

    return model, opt, forward_backward


def timed_step(model, opt, forward_backward, x: torch.Tensor) -> list[float]:
    """The seconds of each of PHASES in one step."""
    t0 = time.perf_counter()
    forward_backward(x)
    t1 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return [t1 - t0, t2 - t1, time.perf_counter() - t2]


def split(vocab: int, steps: int, bf16: bool) -> dict:
    sides = {"Kiln": kiln_side(vocab, bf16), "nanoGPT": nanogpt_side(vocab)}
    gen = torch.Generator().manual_seed(1)
    times: dict[str, list[list[float]]] = {name: [] for name in sides}
    for i in range(steps + 2):  # two warm-up steps left out
        x = torch.randint(0, vocab, (NANOGPT["batch_size"], NANOGPT["block_size"] + 1), generator=gen)
        for name, side in sides.items():
            t = timed_step(*side, x)
            if i >= 2:
                times[name].append(t)
    out = {}
    for name, rows in times.items():
        phases = {ph: statistics.median(r[k] for r in rows) * 1e3 for k, ph in enumerate(PHASES)}
        out[name] = {"phases_ms": phases, "step_ms": statistics.median(sum(r) for r in rows) * 1e3,
                     "without_optimizer_ms": statistics.median(r[0] + r[1] for r in rows) * 1e3}
    tokens = NANOGPT["batch_size"] * NANOGPT["block_size"]
    out["tokens_per_step"] = tokens
    out["tokens_per_s_ratio"] = out["nanoGPT"]["step_ms"] / out["Kiln"]["step_ms"]
    out["without_optimizer_ratio"] = out["nanoGPT"]["step_ms"] / out["Kiln"]["without_optimizer_ms"]
    out["optimizer_share"] = out["Kiln"]["phases_ms"]["optimizer"] / out["Kiln"]["step_ms"]
    return out


def main(argv: list[str] | None = None) -> dict:
    a = demo_bench_args(__doc__, 20, argv)
    from kiln.plan.memory import HardwareConfig, ParallelConfig, cpu_bf16_choice

    bf16 = bool(cpu_bf16_choice(ParallelConfig(), HardwareConfig(device="cpu")))
    r = split(a.vocab, a.steps, bf16)
    k, n = r["Kiln"], r["nanoGPT"]
    dtype = str(optim.ns_dtype(torch.device("cpu"))).removeprefix("torch.")
    lines = [f"{a.steps} timed steps of each side, taking turns; 8 x 256 tokens a step; Kiln in "
             f"{'bf16 autocast' if bf16 else 'fp32'} as the demo's plan picks here, Newton-Schulz in {dtype}; "
             f"torch {torch.__version__}, kernels for {torch.backends.cpu.get_cpu_capability()}.", "",
             "| phase | Kiln, ms | nanoGPT, ms |", "|---|---:|---:|",
             *[f"| {ph} | {k['phases_ms'][ph]:.1f} | {n['phases_ms'][ph]:.1f} |" for ph in PHASES],
             f"| step | {k['step_ms']:.1f} | {n['step_ms']:.1f} |", "",
             f"Kiln's tokens/s **{r['tokens_per_s_ratio']:.2f}x** nanoGPT's; its optimizer step is "
             f"{r['optimizer_share']:.0%} of its step; without it (forward, backward, clipping) Kiln's step would run "
             f"{r['without_optimizer_ratio']:.2f}x nanoGPT's tokens/s."]
    print("\n".join(lines))
    result = {**r, "bf16_autocast": bf16, "ns_dtype": dtype, "steps": a.steps, "vocab": a.vocab}
    if a.out:
        write_results(a.out, "One training step, phase by phase: Kiln's demo model against nanoGPT", lines, result)
        print(f"wrote {a.out}.md and .json")
    return result


if __name__ == "__main__":
    main()
