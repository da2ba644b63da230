"""README's two commands timed as a newcomer meets them: a fresh clone, its own .venv, then ``make test`` or ``make
demo``, the wall time of each (install included), the test count and outcome, and the demo's per-asset times.

Run: ``python bench/bench_fresh_clone.py test|demo [--repo .] [--where /tmp/kiln-fresh] [--workers N]
[--out bench/results/...]``. The clone is of the committed HEAD (uncommitted work is not in it). Writes OUT.md and
OUT.json with the command, commit, date and machine line.

Where the time went is measured beside the wall time: the CPU seconds of the command and every process it waited for
(user and system; a process left running past its parent is not counted), and the machine's own CPU accounting over
the run (/proc/stat: busy, idle and waiting for disk, and stolen by the hypervisor for other tenants), each as a share
of the machine's cores over the wall time; for ``test``, pytest's slowest tests (``--durations``) too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from provenance import header, machine_line  # noqa: E402

STEP = re.compile(r"^✓ (\w+)\s+(?:(\d+)m)?(\d+)s\s*(.*)$")  # asset, minutes, seconds, what it made
SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed).*?) in ([\d.]+)s", re.M)  # pytest's last line (-q or not)
SLOWEST = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+(\S+)$", re.M)  # pytest --durations lines
STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_ticks() -> dict[str, int]:
    """The machine's CPU time so far by kind, in clock ticks (/proc/stat's first line; zeros where it is absent)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:1 + len(STAT_FIELDS)]
    except OSError:
        return dict.fromkeys(STAT_FIELDS, 0)
    return dict(zip(STAT_FIELDS, map(int, fields)))


def cpu_use(before: dict[str, int], after: dict[str, int], children_s: float, wall: float) -> dict:
    """Where the cores' time went over ``wall`` seconds: this command's CPU seconds (``children_s``) and the
    machine's busy, idle, disk-wait and stolen time, each a share of cores x wall."""
    cores = os.cpu_count() or 1
    ticks = {k: after[k] - before[k] for k in STAT_FIELDS}
    total = sum(ticks.values()) or 1
    share = {"busy": ticks["user"] + ticks["nice"] + ticks["system"] + ticks["irq"] + ticks["softirq"],
             "idle": ticks["idle"], "iowait": ticks["iowait"], "steal": ticks["steal"]}
    return {"cores": cores, "command_cpu_s": round(children_s, 1),
            "command_share": round(children_s / (cores * wall), 3) if wall else None,
            "machine": {k: round(v / total, 3) for k, v in share.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("what", choices=["test", "demo"])
    ap.add_argument("--repo", default=str(ROOT))
    ap.add_argument("--where", default="/tmp/kiln-fresh")
    ap.add_argument("--out", default="")
    ap.add_argument("--workers", type=int, default=None, help="make test's TEST_WORKERS (default: the Makefile's)")
    ap.add_argument("--reparse", action="store_true", help="read OUT.json's run log again (no clone, no run) and "
                    "rewrite OUT.md and OUT.json: for a log an older version of this script did not parse")
    args = ap.parse_args(argv)
    out = Path(args.out or ROOT / "bench" / "results" / f"fresh_clone_{args.what}")
    if args.reparse:
        old = json.loads(out.with_suffix(".json").read_text())
        return write(old, Path(old["log"]).read_text(errors="replace"), out, args.what, argv)
    print(f"machine: {machine_line()}", flush=True)
    where = Path(args.where)
    shutil.rmtree(where, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", args.repo, str(where)], check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True).stdout.strip()
    log_path = where.parent / f"{where.name}-{args.what}-{time.strftime('%Y%m%d-%H%M%S')}.log"  # one per run
    make = ["make", args.what] + ([f"TEST_WORKERS={args.workers}"] if args.workers is not None else [])
    ticks, used = cpu_ticks(), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        rc = subprocess.run(make, cwd=where, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    done = resource.getrusage(resource.RUSAGE_CHILDREN)
    children_s = done.ru_utime + done.ru_stime - used.ru_utime - used.ru_stime
    result = {**header(argv if argv is not None else sys.argv), "what": " ".join(make), "clone_commit": commit,
              "returncode": rc, "wall_s": round(wall, 1), "log": str(log_path),
              "cpu": cpu_use(ticks, cpu_ticks(), children_s, wall)}
    return write(result, log_path.read_text(errors="replace"), out, args.what, argv)


def write(result: dict, text: str, out: Path, what: str, argv: list[str] | None) -> int:
    """Parse the run's log into ``result`` and write OUT.json and OUT.md; the run's exit code."""
    commit, rc, wall = result["clone_commit"], result["returncode"], result["wall_s"]
    if what == "test":
        m = SUMMARY.findall(text)
        result["pytest"] = {"summary": m[-1][0], "seconds": float(m[-1][1])} if m else None
        result["slowest"] = [{"seconds": float(t), "phase": ph, "test": name} for t, ph, name in SLOWEST.findall(text)]
    else:
        steps = [STEP.match(line.strip()).groups() for line in text.splitlines() if STEP.match(line.strip())]
        result["assets"] = {a: int(mm or 0) * 60 + int(ss) for a, mm, ss, _ in steps}
        result["outcomes"] = {a: said for a, _, _, said in steps}
        result["tail"] = text.splitlines()[-12:]
    out.with_suffix(".json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    again = header(argv if argv is not None else sys.argv)["command"] if "--reparse" in (argv or sys.argv) else ""
    md = [f"# `{result['what']}` from a fresh clone", "", f"- command: `{result['command']}`",
          f"- commit: {result['commit']}", f"- date: {result['date']}", f"- machine: {result['machine']}",
          *([f"- log read again by: `{again}`"] if again else []), "",
          f"Clone of {commit}; exit code {rc}; {int(wall // 60)} min {int(wall % 60)} s wall, its own .venv install "
          "included (on a shared machine: other tenants' work may have run beside it)."]
    if result.get("pytest"):
        md.append(f"pytest: {result['pytest']['summary']} in {result['pytest']['seconds'] / 60:.1f} min.")
    if result.get("cpu"):
        cpu, mach = result["cpu"], result["cpu"]["machine"]
        md += ["", f"CPU over the wall time, as a share of the machine's {cpu['cores']} cores: the command and the "
               f"processes it waited for used {cpu['command_cpu_s']:,.0f} CPU seconds ({cpu['command_share']:.0%}); "
               f"the machine was busy {mach['busy']:.0%}, idle {mach['idle']:.0%}, waiting for disk "
               f"{mach['iowait']:.0%}, and {mach['steal']:.0%} was taken by the hypervisor for other tenants."]
    if result.get("slowest"):
        md += ["", "| slowest tests | phase | seconds |", "|---|---|---:|",
               *[f"| `{r['test']}` | {r['phase']} | {r['seconds']:.1f} |" for r in result["slowest"]]]
    if result.get("assets"):
        said = result.get("outcomes", {})
        md += ["", "| asset | seconds | what it made |", "|---|---:|---|",
               *[f"| {k} | {v} | {said.get(k, '')} |" for k, v in result["assets"].items()]]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print(f"make {what}: rc {rc}, {wall:.0f} s; wrote {out.with_suffix('.md')}", flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
