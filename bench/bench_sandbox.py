"""The sandbox's cost per program, this checkout's against another's (an older commit's ``git worktree``):
``run("pass")``, and HumanEval samples (canonical solutions of the first problems) through
``kiln.evaluation.coding.execute`` one at a time and on every core.

Run: ``python bench/bench_sandbox.py --before DIR [--label run1] [--rounds 4] [--runs 20] [--problems 20]``. The two
checkouts are measured in alternating rounds, each round a fresh process per checkout, so that a machine whose load
drifts (a shared one) weighs on both alike; medians over every round. Writes bench/results/sandbox_overhead_<label>.md
and .json with the command, commit, date and machine line (bench/provenance.py) and both checkouts' commits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from provenance import header, header_md, machine_line  # noqa: E402

MEASURES = ("run_pass_ms", "humaneval_sample_ms", "humaneval_all_cores_samples_per_s")


def timed_ms(fn, runs: int) -> list[float]:
    """Wall ms of ``runs`` calls after one warm-up call."""
    fn()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def one_round(code: Path, runs: int, n_problems: int, cache_dir: str) -> dict:
    """One round in this process, kiln imported from ``code``: the raw timings."""
    sys.path.insert(0, str(code))
    from kiln.evaluation import sandbox
    from kiln.evaluation.coding import execute, load_humaneval

    if not Path(sandbox.__file__).resolve().is_relative_to(code):
        raise SystemExit(f"imported {sandbox.__file__}, not from {code}")
    problems = load_humaneval(cache_dir)[:n_problems]
    solutions = [[q["canonical_solution"]] for q in problems]
    passed = []
    pass_ms = timed_ms(lambda: sandbox.run("pass"), runs)
    sample_ms = [t / len(problems) for t in timed_ms(
        lambda: passed.append(sum(r.passed for r in execute(problems, solutions, workers=1))), 1)]
    t0 = time.perf_counter()
    passed.append(sum(r.passed for r in execute(problems, solutions, workers=os.cpu_count())))
    rate = len(problems) / (time.perf_counter() - t0)
    return {"isolation": sandbox.isolation().mode, "run_pass_ms": pass_ms, "humaneval_sample_ms": sample_ms,
            "humaneval_all_cores_samples_per_s": [rate], "passed": min(passed), "problems": len(problems)}


def commit_of(code: Path) -> str:
    out = subprocess.run(["git", "-C", str(code), "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the other checkout (e.g. a git worktree of the commit before)")
    p.add_argument("--label", default="run1", help="results file suffix")
    p.add_argument("--rounds", type=int, default=4, help="alternating rounds per checkout")
    p.add_argument("--runs", type=int, default=20, help="timed run('pass') calls per round")
    p.add_argument("--problems", type=int, default=20, help="HumanEval problems per round (the first N), one sample each")
    p.add_argument("--cache-dir", default=os.environ.get("KILN_SOURCE_CACHE", str(Path.home() / ".cache/kiln/sources")))
    p.add_argument("--round-in", help=argparse.SUPPRESS)  # internal: measure one round of this checkout, print JSON
    args = p.parse_args()
    if args.round_in:
        print(json.dumps(one_round(Path(args.round_in), args.runs, args.problems, args.cache_dir)))
        return 0
    print(machine_line(), flush=True)
    codes = {"before": Path(args.before).resolve(), "after": ROOT}
    raw: dict[str, list[dict]] = {name: [] for name in codes}
    load = [round(os.getloadavg()[0], 2)]
    for r in range(args.rounds):
        for name, code in (codes.items() if r % 2 == 0 else reversed(codes.items())):
            out = subprocess.run([sys.executable, __file__, "--before", args.before, "--round-in", str(code),
                                  "--runs", str(args.runs), "--problems", str(args.problems),
                                  "--cache-dir", args.cache_dir], capture_output=True, text=True, check=True)
            raw[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {name}: run('pass') median {statistics.median(raw[name][-1]['run_pass_ms']):.1f} ms",
                  flush=True)
    load.append(round(os.getloadavg()[0], 2))
    summary = {name: {m: round(statistics.median(v for rd in rounds for v in rd[m]), 2) for m in MEASURES}
               for name, rounds in raw.items()}
    result = {**header(), "load_1min": load, "cpus": os.cpu_count(), "rounds": args.rounds, "runs": args.runs,
              "problems": args.problems, "summary": summary,
              "checkouts": {name: {"path": str(code), "commit": commit_of(code), "isolation": raw[name][0]["isolation"],
                                   "passed": f"{min(rd['passed'] for rd in raw[name])}/{args.problems}"}
                            for name, code in codes.items()},
              "raw": raw}
    out = ROOT / "bench" / "results" / f"sandbox_overhead_{args.label}"
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    b, a = summary["before"], summary["after"]
    md = ["# Sandbox cost per program: before and after", "", *header_md(),
          *(f"- {name}: {c['path']} at {c['commit']}; isolation {c['isolation']}; canonical solutions passed "
            f"{c['passed']}" for name, c in result["checkouts"].items()),
          f"- {args.rounds} alternating rounds per checkout, each {args.runs} x run('pass'), {args.problems} HumanEval "
          f"samples one at a time and on {os.cpu_count()} workers; 1-minute load {load[0]} -> {load[1]}", "",
          "| median | before | after | after / before |", "|---|---|---|---|",
          *(f"| {m} | {b[m]} | {a[m]} | {a[m] / b[m]:.2f} |" for m in MEASURES), ""]
    out.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
