"""Benchmark: does the scaling ladder predict the demo model's final validation loss? Side by side in one run: the
loss the ladder's fitted law predicts for the demo model (4.0M parameters, its 1.43M tokens), the loss the demo's
base_model measures, and what Chinchilla's published law (fitted on models 100x-10,000x larger, another corpus and
tokenizer) would have said. Target: the ladder's prediction within 2% of the measured loss.

python bench/bench_ladder.py --home HOME [--seed 1337] [--json out.json]

HOME is a Kiln home (``kiln run --preset demo --home HOME`` made one; a fresh folder makes it first, a few minutes).
The bench runs ``kiln run --preset ladder-demo`` there, selecting the data assets, scaling_ladder, training_plan and
base_model (the evaluation and post-training have nothing to say here): the data assets and base_model are reused when the demo
already ran; scaling_ladder trains its rungs (reused too when the same ladder already ran: pass another ``--seed`` for
an independent second measurement, the ladder's runs trained from other initialisations and data orders), and
training_plan makes the prediction. Everything is read back from the assets' outputs (the Dagster run's own).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def handle(home: Path, asset: str) -> dict:
    """The latest output of ``asset`` in ``home`` (the IO manager's handle on disk)."""
    import pickle

    return pickle.loads((home / "storage" / "handles" / asset).read_bytes())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--home", required=True, help="Kiln home (made by the demo preset when empty)")
    ap.add_argument("--seed", type=int, default=1337, help="training seed of the ladder's rungs")
    ap.add_argument("--json", default="", help="write every figure here")
    ap.add_argument("--widths", default="", help="the ladder's widths, comma-separated (default: ladder-demo's)")
    a = ap.parse_args()
    from kiln.scaling.law import CHINCHILLA

    home = Path(a.home).resolve()
    preset = Path(tempfile.mkdtemp(prefix="bench-ladder-")) / "ladder.yaml"
    preset.write_text(f"extends: {ROOT / 'conf/presets/ladder-demo.yaml'}\n"
                      f"ops:\n  scaling_ladder:\n    config:\n      seed: {a.seed}\n"
                      + (f"      widths: [{a.widths}]\n" if a.widths else ""))
    t0 = time.time()
    select = "pretrained_model,raw_documents,clean_corpus,tokenizer,token_shards,scaling_ladder,training_plan,base_model"
    run = subprocess.run([sys.executable, "-m", "jobs.cli", "run", "--preset", str(preset), "--home", str(home),
                          "--select", select], cwd=ROOT, capture_output=True, text=True)
    took = time.time() - t0
    if run.returncode:
        print(run.stdout[-4000:], run.stderr[-4000:], sep="\n")
        return 1
    ladder, plan, base = handle(home, "scaling_ladder"), handle(home, "training_plan"), handle(home, "base_model")
    law, iso = ladder["law"], ladder["isoflop"]
    if "error" in law:
        print(f"the law did not fit: {law['error']}")
        return 1
    pred = plan["scaling"]
    measured = base["final_val_loss"]
    n, d = pred["params"], pred["tokens"]
    chin = CHINCHILLA["E"] + CHINCHILLA["A"] / n ** CHINCHILLA["alpha"] + CHINCHILLA["B"] / d ** CHINCHILLA["beta"]
    err = pred["predicted_val_loss"] / measured - 1
    rows = ladder["rows"]
    print(f"# bench_ladder (seed {a.seed}): kiln run --preset ladder-demo took {took:.0f} s; the ladder trained "
          f"{sum(not r['reused'] for r in rows)} of {len(rows)} rungs in {sum(r['wall_s'] for r in rows if not r['reused']):.0f} s of training\n")
    print("| rung | budget (FLOPs) | parameters | tokens | steps | final val loss |\n|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['rung']} | {r['budget']:.2g} | {r['params']:,} | {r['tokens']:,} | {r['steps']} | {r['loss']:.4f} |")
    iv = law.get("intervals", {})
    print("\n| coefficient | fitted | 95% bootstrap interval | Chinchilla |\n|---|---:|---:|---:|")
    for k in ("E", "A", "B", "alpha", "beta"):
        lo, hi = iv.get(k, (float("nan"), float("nan")))
        print(f"| {k} | {law[k]:.4g} | {lo:.4g} .. {hi:.4g} | {CHINCHILLA[k]:g} |")
    if "error" not in iso:
        print(f"\napproach 2 (IsoFLOP minima): N_opt ~ C^{iso['a']:.3f}, D_opt ~ C^{iso['b']:.3f} over "
              f"{iso['budgets_used']} usable budgets (Chinchilla: 0.49, 0.51)")
    else:
        print(f"\napproach 2 (IsoFLOP minima): no fit: {iso['error']}")
    print(f"\n| the demo model (N={n:,}, D={d:,}) | final val loss | vs measured |\n|---|---:|---:|")
    print(f"| measured (base_model) | {measured:.4f} | |")
    print(f"| ladder's law | {pred['predicted_val_loss']:.4f} (interval {pred['interval'][0]:.4f} .. "
          f"{pred['interval'][1]:.4f}) | {err:+.2%} |")
    print(f"| Chinchilla's published law | {chin:.4f} | {chin / measured - 1:+.2%} |")
    print(f"\ntarget |error| <= 2%: {'met' if abs(err) <= 0.02 else 'NOT met'} ({err:+.2%}); measured inside the "
          f"bootstrap interval: {pred['interval'][0] <= measured <= pred['interval'][1]}")
    if a.json:
        Path(a.json).write_text(json.dumps({"seed": a.seed, "wall_s": took, "rows": rows, "law": {
            k: law[k] for k in ("E", "A", "B", "alpha", "beta", "intervals", "bootstrap_used")}, "isoflop": iso,
            "measured": measured, "predicted": pred["predicted_val_loss"], "interval": pred["interval"],
            "error": err, "chinchilla": chin}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
