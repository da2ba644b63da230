"""The plans README quotes, as ``kiln plan`` prints them: each GPU preset's data-parallel plan (memory per rank,
hours, cost, the compute-optimal size) or, for a preset with a ``layout`` block, the layout planner's choice with
its runner-up and reference. The planner is arithmetic on the preset and named constants, so the figures are the
same on every machine; the header says which commit made them.

Run: ``python bench/plan_presets.py [--out bench/results/plan_presets]``; writes OUT.md (each plan in full) and
OUT.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from provenance import header, header_md, machine_line  # noqa: E402

PRESETS = ["gpt2-124m-8gpu", "gpt2-124m-1gpu", "gpt2-350m-8gpu", "gpt2-774m-8gpu", "gpt2-124m-1gpu-layout",
           "llama3-8b-8gpu", "llama3-70b-64gpu", "llama3-405b-16k-h100", "qwen3-30b-a3b-8gpu", "qwen3-30b-a3b-64gpu"]


def plan_text(preset: str) -> tuple[int, str]:
    from jobs.cli import main as kiln

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = kiln(["plan", "--preset", preset])
    return code, out.getvalue() + err.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "plan_presets"))
    args = ap.parse_args(argv)
    print(f"machine: {machine_line()}", flush=True)
    plans = {}
    for preset in PRESETS:
        code, text = plan_text(preset)
        if code != 0:
            raise SystemExit(f"kiln plan --preset {preset} exited {code}:\n{text}")
        plans[preset] = text
        print(f"planned {preset}", flush=True)
    argv = argv if argv is not None else sys.argv
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({**header(argv), "plans": plans}, indent=1) + "\n")
    lines = ["# `kiln plan` of the GPU presets", "", *header_md(argv)]
    for preset, text in plans.items():
        lines += [f"## `kiln plan --preset {preset}`", "", "```", text.rstrip(), "```", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print(f"wrote {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
