"""The CPU speedrun: wall time for a recipe to reach a target validation loss on a fixed token set.

python bench/speedrun.py --shards DIR [--json out.json] [--plot curves.png]
python bench/speedrun.py --shards DIR --ablate [--budget-s 150]

DIR is a token_shards folder (train_*.bin, val_*.bin, manifest.json), for example the demo's
`.kiln/storage/token_shards/<version>` after `make demo`; its version pins the tokens. Every recipe trains with
Kiln's own trainer (kiln.train.loop, one fresh process per recipe, checkpoints and MLflow off) on the same shards,
validated on the whole validation split every few steps; validation time is not training time.

Speedrun (the default): (a) ``baseline``, the recipe the demo used before the speedrun (GPT-2 family, AdamW at
2e-3, warmup + cosine, 16 x 256 tokens a step, 800 steps) and (b) ``default``, the pretraining recipe Kiln's demo
runs now (kiln.train.recipe.demo_recipe()). The target is the baseline's final validation loss; printed: each recipe's
time to reach it, the ratio, tokens/s, FLOPs to target, and both loss-vs-time curves (``--plot``).

Time is steps x the median step time of the run (the measured total is reported too): on a shared machine a burst
of other work would otherwise bend one curve and not another.

Ablation (``--ablate``): each lever alone on top of the baseline, the stacks, the default itself and the levers on
top of the default (``ON_DEFAULT``, e.g. ``--ablate --only "default,default + document mask"``), every one trained for the
same wall-time budget (its steps set from a short timing run, so each schedule completes); printed: validation loss
at equal time, steps, tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kiln.train.recipe import BASELINE_RECIPE, demo_recipe, merge  # noqa: E402

# lever -> what it changes on top of the baseline (one at a time)
LEVERS: dict[str, dict] = {
    "muon": {"optim": {"name": "muon"}},
    "lr 4e-3": {"optim": {"lr": 4e-3}},
    "wsd schedule": {"optim": {"schedule": "wsd", "decay_fraction": 0.3}},
    "llama family": {"model": {"family": "llama", "n_kv_head": 2, "bias": False}},
    "batch 8 x 256": {"micro_batch": 8},
    "seq 128 x 32": {"seq_len": 128, "micro_batch": 32},
    "ddp 2 x 1 thread": {"layout": "ddp2", "micro_batch": 8},  # the same 16 sequences a step over two ranks
    "document mask": {"document_mask": True},  # attention within documents only (JobConfig.document_mask)
}
MUON, WSD, LLAMA = LEVERS["muon"], LEVERS["wsd schedule"], LEVERS["llama family"]
# levers stacked (each row adds to the one before)
STACKS: dict[str, list[dict]] = {
    "muon + wsd": [MUON, WSD],
    "muon + wsd + llama": [MUON, WSD, LLAMA],
    "muon + wsd + llama + batch 8": [MUON, WSD, LLAMA, {"micro_batch": 8}],
}
# levers on top of the default recipe (kiln.train.recipe.demo_recipe()), run after it
ON_DEFAULT: dict[str, list[dict]] = {
    "default + document mask": [LEVERS["document mask"]],
}


def job_for(recipe: dict, shards: Path, out: Path, max_steps: int, eval_interval: int) -> dict:
    """A kiln.train.job.JobConfig dict for ``recipe`` on ``shards``."""
    manifest = json.loads((shards / "manifest.json").read_text())
    from kiln.model.config import padded_vocab

    world = 2 if recipe.get("layout") == "ddp2" else 1
    val_tokens = manifest["splits"]["val"]["tokens"]
    batch_tokens = recipe["micro_batch"] * recipe["seq_len"] * world
    return {
        "task": "pretrain", "out_dir": str(out), "model": {"vocab_size": padded_vocab(manifest["vocab_size"]),
                                                           **recipe["model"]},
        "optim": recipe["optim"], "seq_len": recipe["seq_len"], "micro_batch": recipe["micro_batch"],
        "max_steps": max_steps, "eval_interval": eval_interval, "eval_batches": max(1, val_tokens // batch_tokens),
        "ckpt_interval": 10**9, "keep_last": 1, "log_interval": 10**9, "async_save": False, "system_metrics_s": 0,
        "train_files": [str(p) for p in sorted(shards.glob("train_*.bin"))],
        "val_files": [str(p) for p in sorted(shards.glob("val_*.bin"))], "peak_flops": -1,
        "document_mask": bool(recipe.get("document_mask", False)),
        **{k: recipe[k] for k in ("seed", "compile", "cpu_bf16") if k in recipe},  # else the job's defaults
    }


def run(recipe: dict, shards: Path, max_steps: int, eval_interval: int, label: str) -> dict:
    """Train ``recipe`` in a fresh process; the curve is (step, tokens, training seconds, validation loss)."""
    with tempfile.TemporaryDirectory(prefix="speedrun-") as tmp:
        job = job_for(recipe, Path(shards), Path(tmp) / "run", max_steps, eval_interval)
        (Path(tmp) / "job.json").write_text(json.dumps(job))
        times = Path(tmp) / "times.json"
        ddp = recipe.get("layout") == "ddp2"
        cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if ddp
               else [sys.executable]) + [__file__, "--worker", str(Path(tmp) / "job.json"), "--times", str(times)]
        env = {**os.environ, "OMP_NUM_THREADS": "1" if ddp else str(os.cpu_count() or 1), "PYTHONPATH": str(ROOT)}
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"{label}: training failed (exit {proc.returncode})\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        result = json.loads((Path(tmp) / "run" / "result.json").read_text())
        seconds = {int(k): v for k, v in json.loads(times.read_text()).items()}
    tokens_per_step = job["micro_batch"] * job["seq_len"] * (2 if ddp else 1)
    steps = sorted(seconds)
    step_s, curve = median_curve(result["history"], seconds, tokens_per_step)
    from kiln.model.config import ModelConfig
    from kiln.model.families import flops_per_token

    cfg = ModelConfig(**job["model"])
    return {"label": label, "recipe": recipe, "steps": max_steps, "train_s": curve[-1][2], "step_s": step_s,
            "warmup_s": warmup_seconds(seconds, step_s), "measured_train_s": seconds[steps[-1]],
            "wall_s": time.perf_counter() - t0,
            "tokens_per_s": curve[-1][1] / curve[-1][2], "final_val_loss": curve[-1][3], "curve": curve,
            "params": result["params"], "flops_per_token": flops_per_token(cfg, job["seq_len"]),
            # with document_mask, val_loss is measured masked as trained; this is the same batches attending across
            # documents, the measure of the unmasked recipes
            "final_val_loss_unmasked": result["history"][-1].get("val_loss_unmasked")}


def median_curve(history: list[dict], seconds: dict[int, float], tokens_per_step: int) -> tuple[float, list]:
    """(median step seconds, the curve (step, tokens, training seconds, validation loss)) from a run's validations
    and its training seconds after each step. The time axis is steps x the median step time, so a burst of other
    work on a shared machine does not bend a curve; the first two steps warm up and are left out of the median."""
    steps = sorted(seconds)
    durations = [seconds[b] - seconds[a] for a, b in zip(steps, steps[1:]) if a >= 2]
    step_s = float(np.median(durations)) if durations else seconds[steps[-1]] / max(1, steps[-1])
    return step_s, [(h["step"], h["step"] * tokens_per_step, h["step"] * step_s, h["val_loss"]) for h in history]


def warmup_seconds(seconds: dict[int, float], step_s: float) -> float:
    """What the first two steps took beyond two median steps (torch.compile's compilation, first-touch allocation),
    which the curve's time axis leaves out; 0 for a run of fewer steps."""
    return max(0.0, seconds[2] - 2 * step_s) if 2 in seconds else 0.0


def time_to(curve: list, target: float) -> tuple[float, float] | None:
    """(training seconds, tokens) when the validation curve first reaches ``target`` (linear between evaluations)."""
    for (s0, n0, t0, l0), (s1, n1, t1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            f = (l0 - target) / (l0 - l1) if l0 > l1 else 1.0
            return t0 + f * (t1 - t0), n0 + f * (n1 - n0)
    return None


def loss_at(curve: list, seconds: float) -> float:
    return float(np.interp(seconds, [c[2] for c in curve], [c[3] for c in curve]))


def step_seconds(recipe: dict, shards: Path) -> float:
    """Seconds per training step of ``recipe`` here, from a 10-step run."""
    return run(recipe, shards, 12, 10**9, "timing")["step_s"]


def speedrun(a: argparse.Namespace) -> dict:
    shards = Path(a.shards)
    base = run(BASELINE_RECIPE, shards, BASELINE_RECIPE["max_steps"], a.eval_every, "baseline")
    default = demo_recipe()
    new = run(default, shards, default["max_steps"], a.eval_every, "default")
    target = base["final_val_loss"]
    rows = []
    for r in (base, new):
        hit = time_to(r["curve"], target)
        r["time_to_target_s"], r["tokens_to_target"] = hit if hit else (None, None)
        r["flops_to_target"] = r["flops_per_token"] * hit[1] if hit else None
        rows.append(r)
    ratio = base["time_to_target_s"] / new["time_to_target_s"] if new["time_to_target_s"] else None
    print(f"{shards}: target val loss {target:.4f} (the baseline's after {base['steps']} steps)")
    print(f"{'recipe':<9} {'params':>9} {'steps':>6} {'tok/s':>7} {'final val':>9} {'s to target':>11} {'tokens to target':>16} {'FLOPs to target':>15}")
    for r in rows:
        tt = f"{r['time_to_target_s']:.1f}" if r["time_to_target_s"] else "not reached"
        tk = f"{r['tokens_to_target']:,.0f}" if r["tokens_to_target"] else "-"
        fl = f"{r['flops_to_target']:.3e}" if r["flops_to_target"] else "-"
        print(f"{r['label']:<9} {r['params']:>9,} {r['steps']:>6} {r['tokens_per_s']:>7,.0f} {r['final_val_loss']:>9.4f} {tt:>11} {tk:>16} {fl:>15}")
    print(f"time-to-target ratio (baseline / default): {ratio:.2f}x" if ratio else "the default did not reach the target")
    if a.plot:
        from kiln.common.plots import line_plot_png

        series = {r["label"]: [(c[2], c[3]) for c in r["curve"]] for r in rows}
        series[f"target {target:.3f}"] = [(0.0, target), (base["train_s"], target)]
        Path(a.plot).write_bytes(line_plot_png(series, "validation loss vs training time", "training seconds", "val loss (nats/token)"))
        print(f"curves: {a.plot}")
    return {"target": target, "ratio": ratio, "runs": rows}


def stacked(recipe: dict, changes: list[dict]) -> dict:
    """``recipe`` with each change merged on in order (the input is untouched)."""
    for change in changes:
        recipe = merge(recipe, change)
    return recipe


def variants(only: str = "") -> list[tuple[str, dict]]:
    """(label, recipe) of the ablation: the baseline, each lever on it, the stacks, the default and the levers on the
    default; ``only`` (comma-separated labels) keeps those, and an unknown label is an error naming the known ones."""
    out = [("baseline", BASELINE_RECIPE)] + [(k, merge(BASELINE_RECIPE, v)) for k, v in LEVERS.items()]
    out += [(k, stacked(BASELINE_RECIPE, changes)) for k, changes in STACKS.items()]
    out.append(("default", demo_recipe()))
    out += [(k, stacked(demo_recipe(), changes)) for k, changes in ON_DEFAULT.items()]
    if not only:
        return out
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    unknown = [w for w in wanted if w not in dict(out)]
    if unknown:
        raise SystemExit(f"--only {unknown}: not a recipe of the ablation; known: {[k for k, _ in out]}")
    return [v for v in out if v[0] in wanted]


def ablate(a: argparse.Namespace) -> dict:
    shards = Path(a.shards)
    variants_ = variants(a.only)
    rows = []
    budgets = {label: max(20, int(a.budget_s / step_seconds(recipe, shards))) for label, recipe in variants_}
    for label, recipe in variants_:
        steps = budgets[label]
        r = run(recipe, shards, steps, max(5, steps // 12), label)
        rows.append(r)
        unmasked = r["final_val_loss_unmasked"]
        also = f" (across documents {unmasked:.4f})" if unmasked is not None else ""
        print(f"  {label}: {steps} steps in {r['train_s']:.0f} s, val {r['final_val_loss']:.4f}{also}", flush=True)
    equal = min(r["train_s"] for r in rows)
    base = next((r for r in rows if r["label"] == "baseline"), rows[0])
    print(f"{shards}: each recipe trained for about {a.budget_s:.0f} s; loss read at {equal:.0f} s of training; "
          f"differences against {base['label']}")
    print(f"{'lever':<28} {'steps':>6} {'tok/s':>7} {'val@' + format(equal, '.0f') + 's':>9} {'vs baseline':>11}")
    for r in rows:
        r["val_loss_at_equal_time"] = loss_at(r["curve"], equal)
        print(f"{r['label']:<28} {r['steps']:>6} {r['tokens_per_s']:>7,.0f} {r['val_loss_at_equal_time']:>9.4f} "
              f"{r['val_loss_at_equal_time'] - loss_at(base['curve'], equal):>+11.4f}")
    return {"equal_time_s": equal, "runs": rows}


def worker(job_path: str, times_path: str) -> None:
    """Run one training job with a callback that records the training seconds after every step (rank 0)."""
    import torch

    from kiln.train.loop import main
    from kiln.train.trainer import Callback

    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    seconds: dict[int, float] = {0: 0.0}

    class Timer(Callback):
        def on_step_end(self, trainer, step: int) -> None:
            seconds[step] = trainer.run.lineage_s

    class Quiet:
        def log(self, message: str) -> None: ...

    main(["--config", job_path, "--device", "cpu"], reporter=Quiet(), callbacks=[Timer()])
    if int(os.environ.get("RANK", "0")) == 0:
        Path(times_path).write_text(json.dumps(seconds))


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", help="a token_shards folder (train_*.bin, val_*.bin, manifest.json)")
    p.add_argument("--ablate", action="store_true", help="the lever table at equal wall time instead of the speedrun")
    p.add_argument("--budget-s", type=float, default=150.0, help="--ablate: training seconds per recipe")
    p.add_argument("--only", default="", help="--ablate: comma-separated lever names to run (default: all)")
    p.add_argument("--eval-every", type=int, default=25, help="steps between validations in the speedrun")
    p.add_argument("--plot", default="", help="write the loss-vs-time curves to this PNG")
    p.add_argument("--json", default="", help="also write the results to this file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--times", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker(a.worker, a.times)
    if not a.shards or not (Path(a.shards) / "manifest.json").is_file():
        p.error(f"--shards {a.shards!r}: not a token_shards folder (no manifest.json); run `make demo` first and pass "
                ".kiln/storage/token_shards/<version>")
    result = ablate(a) if a.ablate else speedrun(a)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    main()
