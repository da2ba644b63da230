"""RL settings side by side on one materialized home: each variant reruns rl_model (and the red team and the release
it gates) from the same DPO model, then prints its held-out exact match, preference margin and answer log-probability
changes with their paired standard errors and what the stage gate said.

    python bench/bench_rl_variants.py --home H --preset demo \
        --variant 'plain={"preference_coef": 0}' --variant 'replay={}' --variant 'seed1={"seed": 1}'

Each variant is a name and the rl_model config fields it sets over the preset's (JSON). The home must already hold the
preset's data, base, SFT and DPO models (``kiln run --preset P --home H``); only rl_model and what follows it rerun.
A finished variant is reused by its run key, so a rerun prints its table without training. Results are appended to
``--out`` (JSON lines) as each variant finishes.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from provenance import machine_line, write_results  # noqa: E402

MEASURES = ("arithmetic_exact_match", "preference_margin", "arithmetic_answer_logprob", "response_loss")
SHORT = {"arithmetic_exact_match": "exact match", "preference_margin": "margin", "arithmetic_answer_logprob": "answer log p",
         "response_loss": "response loss", "preference_accuracy": "preference accuracy",
         "response_token_accuracy": "token accuracy"}


def preset_file(workdir: Path, preset: str, name: str, fields: dict) -> Path:
    """A preset extending ``preset`` with ``fields`` as rl_model's config."""
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"extends": preset, "ops": {"rl_model": {"config": fields}}}))
    return path


def run_variant(home: Path, preset: str, name: str, fields: dict, workdir: Path) -> dict:
    """Rerun rl_model, red_team_report and release_bundle with ``fields``; the stage's before/after and the gate."""
    path = preset_file(workdir, preset, name, fields)
    cmd = [sys.executable, "-m", "jobs.cli", "run", "--preset", str(path), "--home", str(home),
           "--select", "rl_model,red_team_report,release_bundle"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode and "release_no_regression" not in done.stdout + done.stderr:  # a refused release still counts
        raise SystemExit(f"variant {name}: kiln run failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    handles = home / "storage" / "handles"  # read only after a run that materialized them, never an earlier run's
    rl = pickle.loads((handles / "rl_model").read_bytes())
    bundle = pickle.loads((handles / "release_bundle").read_bytes())
    return result(name, fields, rl, bundle["regressions"])


def result(name: str, fields: dict, rl: dict, regressions: list[str]) -> dict:
    """One variant's row: rl_model's before/after of each measure and what the stage gate refused it for."""
    rows = {r["measure"]: r for r in rl["before_after"]}
    own = [r for r in regressions if r.startswith("rl_model ")]  # the release's own comparisons are not the stage's
    rollouts = [h for h in rl["history"] if "rollout_tokens_per_s" in h]  # (older runs did not record them)
    return {"variant": name, "fields": fields, "steps": rl["steps"], "wall_s": rl.get("wall_s"),
            "step_s": rl["goodput"]["productive_s"] / rl["steps"],  # training time per step, validation left out
            "rollout_s": statistics.median(h["rollout_s"] for h in rollouts) if rollouts else None,
            "rollout_tokens_per_s": statistics.median(h["rollout_tokens_per_s"] for h in rollouts) if rollouts else None,
            **{m: {k: rows[m][k] for k in ("before", "after", "change", "stderr", "z")} for m in MEASURES if m in rows},
            "gate": [SHORT.get(r.split(" made ")[1].split(" worse")[0], r) for r in own]}


def table(results: list[dict]) -> str:
    lines = ["| variant | rl_model fields | exact match before -> after | change ± se | z | preference margin change (z) "
             "| answer log p change (z) | stage gate | RL wall | s per step | rollout s, tokens/s (median) |",
             "|---|---|---|---:|---:|---|---|---|---:|---:|---:|"]
    for r in results:
        em, m, a = r["arithmetic_exact_match"], r["preference_margin"], r["arithmetic_answer_logprob"]
        z = f"**{em['z']:.2f}**" if abs(em["z"] or 0) >= 2 else f"{em['z']:.2f}"
        gate = "passes" if not r["gate"] else "refused: " + ", ".join(r["gate"])
        wall = f"{r['wall_s']:.0f} s" if r.get("wall_s") else "-"
        roll = f"{r['rollout_s']:.3f} s, {r['rollout_tokens_per_s']:,.0f}" if r.get("rollout_s") else "-"
        lines.append(f"| {r['variant']} | `{json.dumps(r['fields'])}` | {em['before']:.3f} -> {em['after']:.3f} | "
                     f"{em['change']:+.3f} ± {em['stderr']:.3f} | {z} | {m['change']:+.3f} ({m['z']:.2f}) | "
                     f"{a['change']:+.3f} ({a['z']:.2f}) | {gate} | {wall} | {r['step_s']:.2f} s | {roll} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--home", type=Path, required=True)
    ap.add_argument("--preset", default="demo", help="the preset the home was built with (a name or a YAML path)")
    ap.add_argument("--variant", action="append", required=True, help="name=JSON of rl_model config fields")
    ap.add_argument("--out", type=Path, default=None, help="append each variant's result here (JSON lines)")
    ap.add_argument("--report", type=Path, default=None,
                    help="write STEM.md and STEM.json: the table, the spread over the variants, the command, commit, "
                         "date and machine")
    args = ap.parse_args(argv)
    variants = []
    for v in args.variant:
        name, _, fields = v.partition("=")
        try:
            variants.append((name, json.loads(fields or "{}")))
        except json.JSONDecodeError as e:
            raise SystemExit(f"--variant {v!r}: the fields after '=' are not JSON ({e})")
    if not (args.home / "storage" / "handles" / "dpo_model").exists():
        raise SystemExit(f"{args.home}: no dpo_model here; materialize the preset first (kiln run --preset {args.preset} "
                         f"--home {args.home})")
    results = []
    print(f"machine: {machine_line()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, fields in variants:
            results.append(run_variant(args.home, args.preset, name, fields, Path(tmp)))
            print(f"{name}: exact match z {results[-1]['arithmetic_exact_match']['z']:.2f}, gate "
                  f"{'passes' if not results[-1]['gate'] else results[-1]['gate']}", flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(results[-1]) + "\n")
    lines = [table(results), "", *spread(results)]
    print("\n".join(lines))
    if args.report:
        about = (f"Home {args.home}, preset {args.preset}: each variant reruns rl_model, red_team_report and "
                 "release_bundle from the same DPO model; held-out measures with paired standard errors (beyond noise "
                 "at |z| >= 2).")
        write_results(args.report, "RL settings side by side", [about, "", *lines], {"results": results})
        print(f"wrote {args.report.with_suffix('.md')} and .json")


def spread(results: list[dict]) -> list[str]:
    """Exact match's change over the variants (as over seeds of one setting): mean, min .. max, how many are beyond
    noise, and how many the stage gate passed."""
    changes = [r["arithmetic_exact_match"]["change"] for r in results]
    beyond = sum(abs(r["arithmetic_exact_match"]["z"] or 0) >= 2 for r in results)
    passed = sum(not r["gate"] for r in results)
    return [f"Held-out exact match change over the {len(results)} variants: mean {sum(changes) / len(changes):+.3f}, "
            f"{min(changes):+.3f} .. {max(changes):+.3f}; beyond noise (|z| >= 2) in {beyond} of {len(results)}; "
            f"the stage gate passed {passed} of {len(results)}."]


if __name__ == "__main__":
    main()
