"""Benchmark, side by side in one run: Muon's fp32 Newton-Schulz (the dtype it runs in on CPUs without AVX-512) by
its iteration's products against the same polynomial through the Gram matrix's eigendecomposition
(kiln.train.optim.spectral_newton_schulz), over a grid of shapes and in the demo's training step.

python bench/ns_spectral.py [--steps 15] [--vocab 4096] [--out bench/results/STEM]

- The grid: random (small, large) matrices, small 64-512, large 1-4x small; the median ms of each way, each one's
  largest difference from the iteration run in fp64, and whether ``spectral_pays`` takes the eigendecomposition.
- The training step of the demo model (llama 4 x 256, SwiGLU 704 wide; 8 x 256 tokens, fp32, forward, backward,
  MuonAdamW with Newton-Schulz in fp32 as a CPU without AVX-512 runs it) with ``spectral_pays`` as it is, against the
  same model and data with the iteration everywhere; both start from the same weights; reported: the median ms of
  each, their ratio, and the largest difference between their weights afterwards.

Each pair of arms alternates call by call so both see the same machine. To measure the AVX2 path on an AVX-512
CPU, run under ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 (the machine line then
says so).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import kiln.train.optim as optim  # noqa: E402
from muon_batches import alternate, demo_bench_args, patched, twin_training  # noqa: E402
from provenance import write_results  # noqa: E402

SMALL, RATIOS = (64, 128, 256, 512), (1, 2, 3, 4)


def iteration_only():
    """newton_schulz never takes the eigendecomposition."""
    return patched("spectral_pays", lambda small, large: False)


def fp32_newton_schulz():
    """Newton-Schulz runs in fp32 on this CPU, as on one without AVX-512."""
    return patched("ns_dtype", lambda device: torch.float32)


def shape_arms(small: int, large: int, steps: int) -> dict:
    g = torch.randn(small, large, generator=torch.Generator().manual_seed(small * 10 + large))
    exact = optim.newton_schulz(g.double(), dtype=torch.float64)

    def products() -> torch.Tensor:
        with iteration_only():
            return optim.newton_schulz(g, dtype=torch.float32)

    def spectral() -> torch.Tensor:
        x = g / g.norm().clamp(min=optim.NS_EPS)
        return optim.spectral_newton_schulz(x)

    t = alternate({"products": products, "spectral": spectral}, steps)
    return {"small": small, "large": large, "products_ms": t["products"] * 1e3, "spectral_ms": t["spectral"] * 1e3,
            "speedup": t["products"] / t["spectral"], "taken": optim.spectral_pays(small, large),
            "products_err": float((products().double() - exact).abs().max()),
            "spectral_err": float((spectral().double() - exact).abs().max())}


@contextlib.contextmanager
def iterating_in_fp32():
    """The iteration's products, in fp32."""
    with fp32_newton_schulz(), iteration_only():
        yield


def train_step_arms(vocab: int, steps: int) -> dict:
    t, models = twin_training(vocab, steps, {"as chosen": fp32_newton_schulz,
                                             "iteration": iterating_in_fp32})
    with torch.no_grad():
        diff = max(float((a - b).abs().max()) for a, b in zip(models["as chosen"].parameters(),
                                                              models["iteration"].parameters()))
    return {"iteration_ms": t["iteration"] * 1e3, "chosen_ms": t["as chosen"] * 1e3,
            "speedup": t["iteration"] / t["as chosen"], "tokens_per_s_iteration": 2048 / t["iteration"],
            "tokens_per_s_chosen": 2048 / t["as chosen"], "weights_max_diff": diff, "steps": steps + 2}


def main(argv: list[str] | None = None) -> dict:
    a = demo_bench_args(__doc__, 15, argv)
    grid = []
    for small in SMALL:
        for r in RATIOS:
            grid.append(shape_arms(small, small * r, a.steps))
            g = grid[-1]
            print(f"{small} x {small * r}: products {g['products_ms']:.2f} ms, spectral {g['spectral_ms']:.2f} ms",
                  flush=True)
    train = train_step_arms(a.vocab, a.steps)
    lines = [f"fp32 throughout; {a.steps} timed calls of each arm, alternating; torch "
             f"{torch.__version__}, kernels for {torch.backends.cpu.get_cpu_capability()}.",
             "", "| matrix | products, ms | eigendecomposition, ms | speed-up | taken | largest difference from fp64: "
             "products | eigendecomposition |", "|---|---:|---:|---:|---|---:|---:|",
             *[f"| {g['small']} x {g['large']} | {g['products_ms']:.2f} | {g['spectral_ms']:.2f} | "
               f"{g['speedup']:.2f}x | {'yes' if g['taken'] else 'no'} | {g['products_err']:.1e} | "
               f"{g['spectral_err']:.1e} |" for g in grid],
             "", f"The demo's training step (fp32, 8 x 256 tokens, forward, backward, MuonAdamW with Newton-Schulz in "
             f"fp32): the iteration everywhere {train['iteration_ms']:.1f} ms "
             f"({train['tokens_per_s_iteration']:,.0f} tokens/s), spectral_pays' choice {train['chosen_ms']:.1f} ms "
             f"({train['tokens_per_s_chosen']:,.0f} tokens/s): **{train['speedup']:.2f}x**; weights after "
             f"{train['steps']} steps each way at most {train['weights_max_diff']:.1e} apart."]
    print("\n".join(lines))
    result = {"grid": grid, "train_step": train, "vocab": a.vocab}
    if a.out:
        write_results(a.out, "Muon's fp32 Newton-Schulz: the iteration against the Gram matrix's eigendecomposition",
                      lines, result)
        print(f"wrote {a.out}.md and .json")
    return result


if __name__ == "__main__":
    main()
