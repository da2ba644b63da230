"""The LoRA / QLoRA / full fine-tuning table of the ``finetune`` preset, from bench_finetune.py's results files:
per run its wall time (first run of the preset in a fresh home, sources prefilled), the largest process's peak
RSS, held-out bits per byte before and after, and each benchmark's change from the imported model (± its 95%
interval). Nothing is measured here: every figure is a results file's, named in the table.

Run: ``python bench/finetune_table.py bench/results/finetune_lora_seed0.json ... [--out bench/results/finetune_variants]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from provenance import header_md  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "finetune_variants"))
    args = ap.parse_args(argv)
    runs = [(Path(f), json.loads(Path(f).read_text())) for f in args.files]
    tasks = [r["task"] for r in runs[0][1]["benchmarks"]]
    head = ["variant", "seed", "results file", "commit", "wall s", "peak RSS GiB", "bits/byte imported -> fine-tuned",
            "change", *tasks]
    lines = ["# The finetune preset: LoRA, QLoRA and full fine-tuning", "", *header_md(argv or sys.argv),
             "Each row is one bench_finetune.py run (its results file and commit named); benchmark cells are the "
             "fine-tuned score minus the imported model's, ± the 95% interval of the difference (100 seeded items, "
             "MMLU 114).", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for path, d in runs:
        bpb = d["heldout_bpb"]
        cells = {r["task"]: (f"{r['diff']:+.2f} ± {r['interval']:.2f}" + (" (forgot)" if r.get("forgot") else ""))
                 if not r.get("missing") else "-" for r in d["benchmarks"]}
        lines.append("| " + " | ".join([
            d["variant"], str(d["seed"]), path.name, d["commit"][:10], f"{d['first_run']['wall_s']:,.0f}",
            "-" if d["first_run"].get("peak_rss_gib") is None else f"{d['first_run']['peak_rss_gib']:.2f}",
            f"{bpb['imported']['bits_per_byte']:.4f} -> {bpb['finetuned']['bits_per_byte']:.4f}",
            f"{d['bpb_change']:+.1%}", *[cells.get(t, "-") for t in tasks]]) + " |")
    out = Path(args.out)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
