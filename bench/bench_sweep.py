"""Benchmark: a hyper-parameter sweep of 8 points on the demo model, then the same sweep again. Side by side in one
run: the sweep's wall time against the sum of its points' own training time (what the partitions, Dagster and
torchrun add), and the rerun's wall time against the first (every point reused, none trained). Targets: the 8 points
in under 15 minutes; all 8 reused on rerun.

python bench/bench_sweep.py --home HOME [--preset sweep-demo] [--out bench/results/STEM]

HOME is a Kiln home; its data assets (raw_documents .. token_shards) are made first when missing, and timed apart.
The sweep is ``kiln sweep --preset sweep-demo`` (conf/presets/sweep-demo.yaml: Muon's and AdamW's learning rates, a
4 x 2 grid, 150 steps of the demo model each). A home where this sweep already ran reuses it the first time too:
use a fresh one (or one with only the data) for the first figure.
"""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from provenance import machine_line, write_results  # noqa: E402


def kiln(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.time()
    run = subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, capture_output=True, text=True)
    if run.returncode:
        print(run.stdout[-4000:], run.stderr[-4000:], sep="\n")
        raise SystemExit(f"kiln {' '.join(args)} failed")
    return time.time() - t0, run


def points(home: Path) -> list[dict]:
    from assets.scaling import point_file
    from resources.storage import KilnStorageResource

    grid = pickle.loads((home / "storage" / "handles" / "sweep_grid").read_bytes())
    storage = KilnStorageResource(root=str(home / "storage"))
    return [json.loads(point_file(storage, grid["version"], p["key"]).read_text()) for p in grid["points"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--home", required=True)
    ap.add_argument("--preset", default="sweep-demo")
    ap.add_argument("--json", default="")
    ap.add_argument("--out", default="", help="write STEM.md and STEM.json (command, commit, date, machine inside)")
    ap.add_argument("--plots", default="", help="copy sweep_results' plots into this folder")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    home = Path(a.home).resolve()
    print(f"machine: {machine_line()}", flush=True)
    data_s, _ = kiln("run", "--preset", a.preset, "--home", str(home), "--select",
                     "pretrained_model,raw_documents,clean_corpus,tokenizer,token_shards")
    first_s, first = kiln("sweep", "--preset", a.preset, "--home", str(home))
    one = points(home)
    again_s, _ = kiln("sweep", "--preset", a.preset, "--home", str(home))
    two = points(home)
    train_s = sum(p["wall_s"] for p in one)
    trained = sum(not p["reused"] for p in one)
    reused = sum(p["reused"] for p in two)
    lines = [f"{len(one)} points ({a.preset}); data assets {data_s:.0f} s (apart)", "",
             "| point | final val loss | steps | training wall s | trained first time |", "|---|---:|---:|---:|---|"]
    lines += [f"| {p['key']} | {p['final_val_loss']:.4f} | {p['steps']} | {p['wall_s']:.1f} | {not p['reused']} |"
              for p in sorted(one, key=lambda p: p["final_val_loss"])]
    lines += ["", "| run | wall s | ratio |", "|---|---:|---:|", f"| the points' own training (sum) | {train_s:.0f} | 1.00 |",
              f"| first sweep (grid, {trained} points trained, results) | {first_s:.0f} | {first_s / train_s:.2f} |",
              f"| rerun ({reused} of {len(two)} points reused) | {again_s:.0f} | {again_s / train_s:.2f} |", "",
              f"target: 8 points under 15 minutes: {'met' if len(one) >= 8 and first_s < 900 else 'NOT met'} "
              f"({first_s / 60:.1f} min); all reused on rerun: {'met' if reused == len(two) else 'NOT met'} "
              f"({reused}/{len(two)})"]
    print("\n".join(lines))
    print(first.stdout.strip().splitlines()[-len(one) - 2:][0])
    if a.out:
        out = Path(a.out)
        write_results(out, "A sweep of the demo model, then the same sweep again", lines, {
            "points": one, "first_s": first_s, "rerun_s": again_s, "data_s": data_s, "train_s": train_s,
            "reused_on_rerun": reused})
    results = pickle.loads((home / "storage" / "handles" / "sweep_results").read_bytes())
    plots = sorted(Path(results["plots"]).glob("*.png")) if results.get("plots") else []
    if a.plots:  # sweep_results' own plots (loss against each swept field, the best points' curves)
        import shutil

        Path(a.plots).mkdir(parents=True, exist_ok=True)
        for f in plots:
            shutil.copy(f, Path(a.plots) / f"sweep_{f.name}")
        print(f"plots: {', '.join(str(Path(a.plots) / f'sweep_{f.name}') for f in plots)}")
    if a.json:
        Path(a.json).write_text(json.dumps({"points": one, "first_s": first_s, "rerun_s": again_s, "data_s": data_s,
                                            "train_s": train_s, "reused_on_rerun": reused}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
