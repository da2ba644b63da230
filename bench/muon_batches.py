"""Benchmark, side by side in one run: Muon's Newton-Schulz over the demo model's matrices one at a time against
same-shaped matrices as one stack (kiln.train.optim.ns_batches / orthogonalise), and the demo's whole training step
each way.

python bench/muon_batches.py [--steps 20] [--vocab 4096] [--out bench/results/STEM]

The model is the demo's (llama 4 x 256, 4 heads sharing 2 key/value heads, SwiGLU 704 wide) with ``--vocab`` tokens
(the demo tokenizer's padded size is 4096). Its 28 Muon matrices come in four shapes: 256 x 256 (q, o), 128 x 256
(k, v), 704 x 256 (gate, up) and 256 x 704 (down).

- Newton-Schulz alone, in bf16 and in fp32 (the dtype it runs in on CPUs with AVX-512 and without): every matrix
  orthogonalised on its own, against one stack per shape (as ns_batches stacks them, the stacking timed with it); the
  largest difference between the two ways' results. Both ways iterate (a wide fp32 matrix alone would otherwise
  take spectral_pays' eigendecomposition, bench/ns_spectral.py).
- The training step (bf16 autocast where this CPU multiplies bf16 natively, as the demo's plan chooses; forward,
  backward, MuonAdamW's step) with ns_batches' batching, against the same model and data with every matrix alone
  (NS_BATCH_BYTES = 0 for that arm); both start from the same weights, and whether they stay equal bit for bit is
  reported.

Each pair of arms alternates step by step so both see the same machine; reported: the median ms of each and their
ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, ContextManager

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import kiln.train.optim as optim  # noqa: E402
from kiln.model.config import MODEL_PRESETS, ModelConfig  # noqa: E402
from kiln.model.families import build_model  # noqa: E402
from provenance import machine_line, write_results  # noqa: E402


def demo_model(vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(family="llama", **{**MODEL_PRESETS["llama"]["demo"], "vocab_size": vocab}))


def muon_matrices(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p for n, p in model.named_parameters() if optim.is_muon_parameter(n, p)]


def same_shape(mats: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The matrices grouped by shape, first seen first (ns_batches' groups on a CPU that stacks)."""
    same: dict[tuple[int, int], list[torch.Tensor]] = {}
    for m in mats:
        same.setdefault(tuple(m.shape), []).append(m)
    return list(same.values())


def alternate(arms: dict[str, callable], steps: int) -> dict[str, float]:
    """Median seconds of each arm's call, the arms taking turns; two warm-up rounds left out."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    for i in range(steps + 2):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            fn()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def newton_schulz_arms(mats: list[torch.Tensor], dtype: torch.dtype, steps: int) -> dict:
    """Newton-Schulz in ``dtype`` over random gradients of ``mats``' shapes: one at a time against one stack per
    shape, the stacking timed with it (as orthogonalise stacks)."""
    groups = same_shape([torch.randn_like(m) for m in mats])

    def one_at_a_time() -> list[torch.Tensor]:  # by the iteration's products, as a stack is (not spectral_pays')
        with patched("spectral_pays", lambda small, large: False):
            return [optim.newton_schulz(g, dtype=dtype) for group in groups for g in group]

    def stacked() -> list[torch.Tensor]:
        return [o for group in groups for o in optim.newton_schulz(torch.stack(group), dtype=dtype).unbind(0)]

    one, many = torch.cat([o.reshape(-1) for o in one_at_a_time()]), torch.cat([o.reshape(-1) for o in stacked()])
    t = alternate({"one at a time": one_at_a_time, "stacked": stacked}, steps)
    return {"dtype": str(dtype).removeprefix("torch."), "one_ms": t["one at a time"] * 1e3,
            "stacked_ms": t["stacked"] * 1e3, "speedup": t["one at a time"] / t["stacked"],
            "max_abs_diff": float((one.float() - many.float()).abs().max())}


@contextlib.contextmanager
def patched(name: str, value):
    """Within it, kiln.train.optim's ``name`` is ``value``."""
    saved = getattr(optim, name)
    setattr(optim, name, value)
    try:
        yield
    finally:
        setattr(optim, name, saved)


def twin_training(vocab: int, steps: int, arms: dict[str, Callable[[], ContextManager]], bf16: bool = False
                  ) -> tuple[dict[str, float], dict[str, torch.nn.Module]]:
    """The demo model and exact copies of it, one per arm, each with MuonAdamW as the demo builds it, trained on the
    same batches (8 x 256 tokens), the arms taking turns step by step; each arm's optimizer step runs inside its
    context (``arms[name]()``). Returns the median seconds of each arm's step and the models."""
    base = demo_model(vocab)
    models = {name: base if i == 0 else copy.deepcopy(base) for i, name in enumerate(arms)}
    opts = {k: optim.make_optimizer(m, optim.OptimConfig(**optim.PRETRAIN_OPTIM), torch.device("cpu"))
            for k, m in models.items()}
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (8, 257), generator=gen) for _ in range(steps + 2)]
    count = {k: 0 for k in models}

    def step(name: str) -> None:
        x = batches[count[name]]
        count[name] += 1
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = models[name](x[:, :-1], x[:, 1:])
        loss.backward()
        with arms[name]():
            opts[name].step()
        opts[name].zero_grad(set_to_none=True)

    return alternate({name: (lambda name=name: step(name)) for name in models}, steps), models


def train_step_arms(vocab: int, steps: int, bf16: bool) -> dict:
    t, models = twin_training(vocab, steps, {"stacked": contextlib.nullcontext,  # 0 bytes: every matrix alone
                                             "one at a time": lambda: patched("NS_BATCH_BYTES", 0)}, bf16)
    same = all(torch.equal(a, b) for a, b in zip(models["stacked"].parameters(), models["one at a time"].parameters()))
    return {"bf16_autocast": bf16, "one_ms": t["one at a time"] * 1e3, "stacked_ms": t["stacked"] * 1e3,
            "speedup": t["one at a time"] / t["stacked"], "tokens_per_s_one": 2048 / t["one at a time"],
            "tokens_per_s_stacked": 2048 / t["stacked"], "weights_equal": same, "steps": steps}


def demo_bench_args(doc: str, steps: int, argv: list[str] | None) -> argparse.Namespace:
    """``--steps`` (timed calls of each arm, after two warm-up calls), ``--vocab`` (the demo's padded 4096 unless
    given) and ``--out`` (STEM.md and STEM.json), checked; the machine line printed before any timing."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=steps, help="timed calls of each arm (after two warm-up calls)")
    p.add_argument("--vocab", type=int, default=4096, help="the model's vocabulary (the demo's padded size: 4096)")
    p.add_argument("--out", default="", help="write STEM.md and STEM.json (command, commit, date, machine inside)")
    a = p.parse_args(argv)
    if a.steps < 1 or a.vocab < 2:
        p.error(f"--steps {a.steps} / --vocab {a.vocab}: at least 1 step and 2 tokens")
    print(f"machine: {machine_line()}", flush=True)
    return a


def main(argv: list[str] | None = None) -> dict:
    a = demo_bench_args(__doc__, 20, argv)
    mats = muon_matrices(demo_model(a.vocab))
    ns = [newton_schulz_arms(mats, d, a.steps) for d in (torch.bfloat16, torch.float32)]
    from kiln.plan.memory import HardwareConfig, ParallelConfig, cpu_bf16_choice

    bf16 = bool(cpu_bf16_choice(ParallelConfig(), HardwareConfig(device="cpu")))
    train = train_step_arms(a.vocab, a.steps, bf16)
    shapes = sorted({(len(g), *g[0].shape) for g in same_shape(mats)}, reverse=True)
    stack_list = ", ".join(" x ".join(map(str, s)) for s in shapes)
    dtype = str(optim.ns_dtype(torch.device("cpu"))).removeprefix("torch.")
    lines = [f"The demo model's {len(mats)} Muon matrices (stacks {stack_list}); {a.steps} timed calls of each arm, "
             f"alternating. This CPU runs Newton-Schulz in {dtype}; ns_batches stacks where it runs in bf16.",
             "", "| Newton-Schulz over every matrix, in | one at a time, ms | stacked, ms | speed-up | "
             "largest difference |",
             "|---|---:|---:|---:|---:|",
             *[f"| {r['dtype']} | {r['one_ms']:.1f} | {r['stacked_ms']:.1f} | {r['speedup']:.2f}x | "
               f"{r['max_abs_diff']:.1e} |" for r in ns],
             "", f"The training step ({'bf16 autocast' if bf16 else 'fp32'}, 8 x 256 tokens, forward, backward, "
             f"MuonAdamW): every matrix alone {train['one_ms']:.1f} ms ({train['tokens_per_s_one']:,.0f} tokens/s), "
             f"ns_batches {train['stacked_ms']:.1f} ms ({train['tokens_per_s_stacked']:,.0f} tokens/s): "
             f"**{train['speedup']:.2f}x**; weights after {a.steps + 2} steps each way "
             f"{'equal bit for bit' if train['weights_equal'] else 'NOT equal'}."]
    print("\n".join(lines))
    result = {"newton_schulz": ns, "train_step": train, "vocab": a.vocab}
    if a.out:
        write_results(a.out, "Muon's Newton-Schulz: one matrix at a time against same-shaped stacks", lines, result)
        print(f"wrote {a.out}.md and .json")
    return result


if __name__ == "__main__":
    main()
