"""Benchmark: does the scaling ladder predict the demo model's final validation loss? Side by side in one run: the
loss the ladder's fitted law predicts for the demo model (4.0M parameters, its 1.43M tokens), the loss the demo's
base_model measures, and what Chinchilla's published law (fitted on models 100x-10,000x larger, another corpus and
tokenizer) would have said. Target: the ladder's prediction within 2% of the measured loss.

python bench/bench_ladder.py --home HOME [--seed 1337] [--target NAME=YAML ...] [--out bench/results/STEM]

HOME is a Kiln home (``kiln run --preset demo --home HOME`` made one; a fresh folder makes it first, a few minutes).
The bench runs ``kiln run --preset ladder-demo`` there, selecting the data assets, scaling_ladder, training_plan and
base_model (the evaluation and post-training have nothing to say here): the data assets and base_model are reused when the demo
already ran; scaling_ladder trains its rungs (reused too when the same ladder already ran: pass another ``--seed`` for
an independent second measurement, the ladder's runs trained from other initialisations and data orders), and
training_plan makes the prediction. Everything is read back from the assets' outputs (the Dagster run's own).

``--target NAME=YAML`` (repeatable) predicts other models than the demo's: each is ops overrides over ladder-demo
(another width, another step count), trained by base_model after the same ladder (reused after the first target), so
the law is tested on models that took no part in choosing the ladder's widths.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from provenance import machine_line, write_results  # noqa: E402


def handle(home: Path, asset: str) -> dict:
    """The latest output of ``asset`` in ``home`` (the IO manager's handle on disk)."""
    import pickle

    return pickle.loads((home / "storage" / "handles" / asset).read_bytes())


def preset_text(seed: int, widths: str, target: dict) -> str:
    """ladder-demo with the ladder's seed (and widths) and ``target``'s ops overrides (the model the law predicts)."""
    ops: dict = {"scaling_ladder": {"config": {"seed": seed, **({"widths": [int(w) for w in widths.split(",")]}
                                                                  if widths else {})}}}
    for asset, block in target.items():
        ops.setdefault(asset, {}).setdefault("config", {}).update(block.get("config", {}))
    return yaml.safe_dump({"extends": str(ROOT / "conf/presets/ladder-demo.yaml"), "ops": ops}, sort_keys=False)


def error_row(name: str, pred: dict, measured: float) -> dict:
    """One target: the law's prediction, its interval, the measured loss, the error and whether the interval holds it."""
    lo, hi = pred["interval"]
    return {"target": name, "params": pred["params"], "tokens": pred["tokens"], "predicted": pred["predicted_val_loss"],
            "interval": [lo, hi], "interval_pct": [lo / measured - 1, hi / measured - 1], "measured": measured,
            "error": pred["predicted_val_loss"] / measured - 1, "inside": lo <= measured <= hi}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--home", required=True, help="Kiln home (made by the demo preset when empty)")
    ap.add_argument("--seed", type=int, default=1337, help="training seed of the ladder's rungs")
    ap.add_argument("--widths", default="", help="the ladder's widths, comma-separated (default: ladder-demo's)")
    ap.add_argument("--target", action="append", default=[], metavar="NAME=YAML",
                    help="a model for the law to predict, as ops overrides over ladder-demo (e.g. "
                         "'half=training_plan: {config: {batch: {max_steps: 350}}}'); repeatable; default: the demo")
    ap.add_argument("--out", default="", help="write STEM.md and STEM.json (command, commit, date, machine inside)")
    a = ap.parse_args()
    from kiln.scaling.law import CHINCHILLA

    targets = {"demo": {}}
    if a.target:
        targets = {}
        for t in a.target:
            name, _, text = t.partition("=")
            targets[name] = yaml.safe_load(text) or {}
    home = Path(a.home).resolve()
    work = Path(tempfile.mkdtemp(prefix="bench-ladder-"))
    print(f"machine: {machine_line()}", flush=True)
    select = "pretrained_model,raw_documents,clean_corpus,tokenizer,token_shards,scaling_ladder,training_plan,base_model"
    rows_out, ladder, took = [], None, {}
    for name, target in targets.items():
        preset = work / f"{name}.yaml"
        preset.write_text(preset_text(a.seed, a.widths, target))
        t0 = time.time()
        run = subprocess.run([sys.executable, "-m", "jobs.cli", "run", "--preset", str(preset), "--home", str(home),
                              "--select", select], cwd=ROOT, capture_output=True, text=True)
        took[name] = time.time() - t0
        if run.returncode:
            print(run.stdout[-4000:], run.stderr[-4000:], sep="\n")
            return 1
        ladder, plan, base = handle(home, "scaling_ladder"), handle(home, "training_plan"), handle(home, "base_model")
        if "error" in ladder["law"]:
            print(f"the law did not fit: {ladder['law']['error']}")
            return 1
        row = error_row(name, plan["scaling"], base["final_val_loss"])
        n, d = row["params"], row["tokens"]
        row["chinchilla"] = CHINCHILLA["E"] + CHINCHILLA["A"] / n ** CHINCHILLA["alpha"] + CHINCHILLA["B"] / d ** CHINCHILLA["beta"]
        row["overrides"] = target
        rows_out.append(row)
        print(f"{name}: predicted {row['predicted']:.4f}, measured {row['measured']:.4f} ({row['error']:+.2%}) in "
              f"{took[name]:.0f} s", flush=True)
    law, iso, rows = ladder["law"], ladder["isoflop"], ladder["rows"]
    lines = [f"The ladder (seed {a.seed}) trained {sum(not r['reused'] for r in rows)} of {len(rows)} rungs in "
             f"{sum(r['wall_s'] for r in rows if not r['reused']):.0f} s of training; `kiln run` took "
             + ", ".join(f"{took[t]:.0f} s ({t})" for t in targets) + ".", "",
             "| rung | budget (FLOPs) | parameters | tokens | steps | final val loss |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['rung']} | {r['budget']:.2g} | {r['params']:,} | {r['tokens']:,} | {r['steps']} | {r['loss']:.4f} |"
              for r in rows]
    iv = law.get("intervals", {})
    lines += ["", "| coefficient | fitted | 95% bootstrap interval | Chinchilla |", "|---|---:|---:|---:|"]
    for k in ("E", "A", "B", "alpha", "beta"):
        lo, hi = iv.get(k, (float("nan"), float("nan")))
        lines.append(f"| {k} | {law[k]:.4g} | {lo:.4g} .. {hi:.4g} | {CHINCHILLA[k]:g} |")
    lines.append("")
    lines.append(f"approach 2 (IsoFLOP minima): N_opt ~ C^{iso['a']:.3f}, D_opt ~ C^{iso['b']:.3f} over "
                 f"{iso['budgets_used']} usable budgets (Chinchilla: 0.49, 0.51)" if "error" not in iso else
                 f"approach 2 (IsoFLOP minima): no fit: {iso['error']}")
    lines += ["", "| target | overrides | parameters | tokens | measured (base_model) | ladder's law (95% interval) | "
              "error | interval as % of measured | measured inside | Chinchilla's published law |",
              "|---|---|---:|---:|---:|---|---:|---|---|---:|"]
    for r in rows_out:
        lines.append(f"| {r['target']} | `{json.dumps(r['overrides']) if r['overrides'] else 'none'}` | {r['params']:,} | "
                     f"{r['tokens']:,} | {r['measured']:.4f} | {r['predicted']:.4f} ({r['interval'][0]:.4f} .. "
                     f"{r['interval'][1]:.4f}) | {r['error']:+.2%} | {r['interval_pct'][0]:+.1%} .. "
                     f"{r['interval_pct'][1]:+.1%} | {'yes' if r['inside'] else 'no'} | {r['chinchilla']:.4f} |")
    print("\n".join(lines))
    if a.out:
        out = Path(a.out)
        write_results(out, "The scaling ladder's law against measured losses", lines, {"seed": a.seed, "rows": rows, "law": {
            k: law[k] for k in ("E", "A", "B", "alpha", "beta", "intervals", "bootstrap_used")}, "isoflop": iso,
            "targets": rows_out, "wall_s": took})
        print(f"wrote {out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
