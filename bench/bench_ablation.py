"""A data ablation (or a mixture sweep) end to end, twice: ``kiln ablate --preset P`` in a fresh home, timed, then
again in the same home, where every point must be reused; the verdict table (and the mixture's regression and
verification) from the report ablation_report wrote, and the machine line.

Run: ``python bench/bench_ablation.py --preset ablation-demo --out bench/results/ablation_demo``
(``--preset mixture-demo`` for the mixture). ``--cache-from DIR`` copies a source cache (a home's storage/cache)
into the fresh home first, so that the time is the ablation's and not the package downloads'.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from provenance import header, header_md, machine_line  # noqa: E402


def ablate(preset: str, home: Path) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "ablate", "--preset", preset, "--home", str(home)],
                          cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"kiln ablate --preset {preset} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return wall, proc.stdout


def newest_report(home: Path) -> dict:
    reports = sorted((home / "storage" / "ablation_report").glob("*/report.json"), key=lambda p: p.stat().st_mtime)
    if not reports:
        raise SystemExit(f"no ablation_report/*/report.json under {home}/storage")
    return json.loads(reports[-1].read_text())


def f(v, digits: int = 4) -> str:
    if v is None:
        return "-"
    return f"{v:+.{digits}f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)


def table(report: dict) -> list[str]:
    lines = ["| point | documents kept | training tokens | epochs | bits per byte (mean) | Δ vs baseline | 95% interval "
             "| seed sd (baseline, point) | verdict |", "|---|---:|---:|---:|---:|---:|---|---|---|"]
    for r in report["rows"]:
        if "bpb" not in r:
            lines.append(f"| {r['point']} | - | - | - | - | - | - | - | {r['verdict']}: {r.get('note', '')} |")
            continue
        interval = f"[{r['low']:+.4f}, {r['high']:+.4f}]" if r.get("low") is not None else "-"
        sds = f"{r['base_sd']:.4f}, {r['point_sd']:.4f}" if r.get("base_sd") is not None else "-"
        lines.append(f"| {r['point']} | {r['kept_docs']:,} | {r['train_tokens']:,} | {r['epochs']:.2f} | {r['bpb']:.4f} "
                     f"| {r['diff']:+.4f} | {interval} | {sds} | {r['verdict']} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="ablation-demo")
    ap.add_argument("--out", required=True, help="results path without suffix (writes .md and .json)")
    ap.add_argument("--home", default="", help="the home to run in (default: a fresh temporary folder)")
    ap.add_argument("--cache-from", default="", help="a home's storage/cache to copy in first (the source packages)")
    ap.add_argument("--seeds", default="", help="comma-separated proxy seeds replacing the preset's (a second run on "
                    "seeds that took no part in the first)")
    args = ap.parse_args(argv)
    print(f"machine: {machine_line()}", flush=True)
    home = Path(args.home or tempfile.mkdtemp(prefix="kiln-ablate-"))
    if args.cache_from:
        shutil.copytree(args.cache_from, home / "storage" / "cache", dirs_exist_ok=True)
    preset = args.preset
    if args.seeds:  # the preset, extended with other seeds
        import yaml

        seeds = [int(s) for s in args.seeds.split(",")]
        preset = str(home / f"{Path(args.preset).stem}-seeds.yaml")
        Path(preset).write_text(yaml.safe_dump({"extends": args.preset, "ops": {"ablation_grid": {"config": {"seeds": seeds}}}}))
    first, out1 = ablate(preset, home)
    print(out1[-3000:], flush=True)
    report1 = newest_report(home)
    second, out2 = ablate(preset, home)
    report2 = newest_report(home)
    argv = argv if argv is not None else sys.argv
    result = {**header(argv), "preset": args.preset, "seeds": args.seeds, "first_s": round(first, 1), "second_s": round(second, 1),
              "report": report1, "rerun_reused_points": report2["reused_points"], "rerun_points": report2["points"],
              "rerun_same_rows": report1["rows"] == report2["rows"], "stdout": out1[-6000:]}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    proxy = report1["proxy"]
    lines = [f"# `kiln ablate --preset {args.preset}`", "", *header_md(argv),
             f"Fresh home{' (source packages copied in from a cache)' if args.cache_from else ''}; first run "
             f"**{first / 60:.1f} min** (data assets, grid, every point, report); the rerun in the same home "
             f"**{second:.0f} s**, reusing {report2['reused_points']} of {report2['points']} points whole "
             f"(same table: {result['rerun_same_rows']}).", "",
             f"Proxy: {proxy['model_preset']} + {proxy['model']}: {proxy['params']:,} parameters, "
             f"{proxy['tokens']:,} tokens per seed ({proxy['tokens_per_step']:,} a step), seeds {proxy['seeds']}. "
             f"Evaluation set: {report1['eval']['documents']} documents, {report1['eval']['bytes']:,} bytes "
             f"(sha256 {report1['eval']['sha256'][:16]}), removed from every point's training data with their "
             "near-duplicates.", "", *table(report1), ""]
    if report1["samples"]:
        lines += ["What each change removed or let in (documents against the baseline's corpus):", ""]
        lines += [f"- {k}: removed {s['removed_count']}, let in {s['let_in_count']}" for k, s in report1["samples"].items()]
        lines.append("")
    mix = report1.get("mixture")
    if mix:
        fit, best, ver = mix["fit"], mix["best"], mix["verification"]
        lines += ["## Mixture", "", "| mixture | " + " | ".join(fit["groups"]) + " | bits per byte |",
                  "|---|" + "---:|" * (len(fit["groups"]) + 1)]
        lines += [f"| {r['point']} | " + " | ".join(f"{r[g]:.3f}" for g in fit["groups"]) + f" | {r['bpb']:.4f} |"
                  for r in mix["trained"]]
        lines += ["", f"Regression (linear in the shares, ridge {fit['ridge']}) over {fit['n']} mixtures: R² "
                  f"{fit['r2']:.3f}; leave-one-out mean absolute error **{fit['loo_mae']:.4f}** bits per byte against "
                  f"{fit['loo_mae_mean']:.4f} predicting the mean of the others.", "",
                  f"Predicted best mixture (mean of the {best['top']} best of {best['candidates']:,} candidates): "
                  f"{best['shares']}, predicted {best['predicted_bpb']:.4f} bits per byte.", "",
                  f"Verification, {len(ver['seeds'])} seeds, predicted best minus default mixture: **{ver['diff']:+.4f}** "
                  f"[{f(ver['low'])}, {f(ver['high'])}], seed sd {ver['base_sd']:.4f} (default) and {ver['point_sd']:.4f} "
                  f"(best): **{ver['verdict']}**.", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print(f"wrote {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
