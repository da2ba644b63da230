"""Benchmark: 16-bit LoRA (bf16 frozen base) against QLoRA (NF4 frozen base) on the same model, side by side in one
run: bytes of the frozen base, peak resident memory during forward+backward steps at a fixed batch, step time, and
the loss gap between the two on the same batch.

Run: python bench/bench_qlora.py [--preset 125m] [--family llama] [--batch 1] [--seq 128] [--steps 2] [--rank 8]

Each variant runs in its own fresh process (spawned), so neither sees the other's freed memory. Peak memory is the
process's peak RSS (VmHWM), reset through /proc/self/clear_refs once the model is built, quantised and warmed up by one
step: torch's CPU allocator keeps no peak statistics, and tracemalloc sees Python's allocator only, not torch's.
So that RSS follows live tensors, glibc's heap is trimmed (malloc_trim) before the reset: the bf16 weights an NF4
base was quantised from, and quantisation's temporaries, are then returned to the system rather than kept as free
heap. The net figure subtracts the RSS after importing torch and torchao (the same in both). On CUDA the peak is torch.cuda.max_memory_allocated instead. Weights are random (init std 0.02);
the adapters are float32 in both.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from provenance import header, header_md, machine_line  # noqa: E402


def rss_kib(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def variant(quantize: str, args: argparse.Namespace, out: mp.Queue) -> None:
    """One variant in this (fresh) process: build, adapt, measure; the figures go to ``out``."""
    import torch

    from kiln.model.config import ModelConfig, preset_fields
    from kiln.model.families import build_model
    from kiln.model.lora import LoRAConfig, apply_lora
    from kiln.model.quant import _nf4, storage_bytes

    _nf4()  # torchao imported in both processes: the baseline holds the same libraries
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    base_kib = rss_kib()
    torch.manual_seed(0)
    cfg = ModelConfig(**{**preset_fields(args.preset, args.family), "vocab_size": args.vocab})
    model = build_model(cfg).to(torch.bfloat16)  # the frozen base in 16 bits
    apply_lora(model, LoRAConfig(enabled=True, rank=args.rank, quantize=quantize))
    model.to(device)
    gc.collect()
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    targets = [(n, p) for n, p in frozen if n.endswith("base.weight")]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(device)  # (B, T)
    y = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(device)  # (B, T)
    with torch.no_grad():
        first_loss = model(x, y).item()  # adapters at B = 0: the loss of the frozen base itself
        logits = model(x[:1, :32]).float().cpu().numpy()  # (1, 32, V) for the logit gap (numpy: sent by value)

    def step() -> float:
        t0 = time.perf_counter()
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    step()  # warm-up: optimizer state, allocator pools
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    reset_peak()
    setup_kib = rss_kib()
    times = [step() for _ in range(args.steps)]
    peak = torch.cuda.max_memory_allocated() / 1024 if cuda else rss_kib("VmHWM")
    out.put({"quantize": quantize, "params": sum(p.numel() for p in model.parameters()),
             "frozen_bytes": sum(storage_bytes(p) for _, p in frozen),
             "target_bytes": sum(storage_bytes(p) for _, p in targets), "n_targets": len(targets),
             "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
             "base_kib": base_kib, "setup_kib": setup_kib, "peak_kib": peak, "cuda": cuda,
             "step_s": sorted(times)[len(times) // 2], "loss": first_loss,
             "logits": logits})


def run(quantize: str, args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=variant, args=(quantize, args, q))
    p.start()
    res = q.get()
    p.join()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="125m", help="a kiln.model.config size (llama: 125m, smollm-135m, ...)")
    ap.add_argument("--family", default="llama")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2, help="timed forward+backward+AdamW steps after one warm-up")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "qlora",
                    help="writes OUT.md and OUT.json with the command, commit, date and machine")
    args = ap.parse_args()
    print(f"machine: {machine_line()}", flush=True)
    a, b = run("none", args), run("nf4", args)
    mib = lambda kib: kib / 1024  # noqa: E731
    print(f"{args.family} {args.preset} ({a['params'] / 1e6:.1f}M parameters, vocab {args.vocab}), LoRA rank "
          f"{args.rank} on {a['n_targets']} layers ({a['trainable']:,} trainable), batch {args.batch} x {args.seq}, "
          f"{'CUDA max_memory_allocated' if a['cuda'] else 'peak RSS (VmHWM)'}")
    print(f"{'':28}{'bf16 LoRA':>12}{'QLoRA (NF4)':>14}{'ratio':>8}")
    rows = [("frozen base, targets (MiB)", a["target_bytes"] / 2**20, b["target_bytes"] / 2**20),
            ("frozen base, all (MiB)", a["frozen_bytes"] / 2**20, b["frozen_bytes"] / 2**20),
            ("RSS after import (MiB)", mib(a["base_kib"]), mib(b["base_kib"])),
            ("RSS before steps (MiB)", mib(a["setup_kib"]), mib(b["setup_kib"])),
            ("peak during steps (MiB)", mib(a["peak_kib"]), mib(b["peak_kib"])),
            ("peak net of import (MiB)", mib(a["peak_kib"] - a["base_kib"]), mib(b["peak_kib"] - b["base_kib"])),
            ("step time (s, median)", a["step_s"], b["step_s"])]
    for name, u, v in rows:
        print(f"{name:28}{u:12.2f}{v:14.2f}{u / v:8.2f}x")
    gap = abs(a["loss"] - b["loss"])
    rel = float(np.linalg.norm(a["logits"] - b["logits"]) / np.linalg.norm(a["logits"]))
    said = (f"loss on the same batch: bf16 {a['loss']:.5f}, NF4 {b['loss']:.5f}, gap {gap:.2e} "
            f"({gap / a['loss']:.3%}; ln(vocab) = {math.log(args.vocab):.5f}); logits' relative RMS gap {rel:.3f}")
    print(said)
    setup = (f"{args.family} {args.preset} ({a['params'] / 1e6:.1f}M parameters, vocab {args.vocab}), LoRA rank "
             f"{args.rank} on {a['n_targets']} layers ({a['trainable']:,} trainable), batch {args.batch} x {args.seq}, "
             f"{args.steps} timed steps after one warm-up, each side in a process of its own; memory is "
             f"{'CUDA max_memory_allocated' if a['cuda'] else 'peak RSS (VmHWM)'}.")
    args.out.with_suffix(".json").write_text(json.dumps({**header(), "setup": setup, "rows": [
        {"measure": n, "bf16_lora": u, "qlora_nf4": v} for n, u, v in rows], "loss_bf16": a["loss"],
        "loss_nf4": b["loss"], "logits_relative_rms_gap": rel}, indent=1) + "\n")
    lines = ["# QLoRA (NF4 frozen base) against bf16 LoRA", "", *header_md(), setup, "",
             "| measure | bf16 LoRA | QLoRA (NF4) | ratio |", "|---|---:|---:|---:|"]
    lines += [f"| {n} | {u:,.2f} | {v:,.2f} | {u / v:.2f}x |" for n, u, v in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines + ["", said]) + "\n")
    print(f"wrote {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
