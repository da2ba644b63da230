"""Evaluation speed: Kiln's lm-eval adapter (KilnLM) against lm-eval's own transformers model (HFLM) on the same model,
the same items and the same machine, in one process: requests/s and wall time of each side's ``loglikelihood`` call,
their ratio, and the largest |delta| of a request's log-likelihood between them.

Three sides answer the very same lm-eval request list per benchmark: ``hf`` (lm-eval's HFLM, transformers), ``kiln``
(KilnLM: each context run once into a KV cache without logits, its endings scored against it:
kiln/evaluation/adapter.py ``_score_shared``) and ``kiln_noshare`` (the same KilnLM object with ``share_context`` off:
one whole row per request, the path before sharing), so the speed-up of sharing alone shows beside the one against
HFLM. Each benchmark's requests are built once with
lm-eval's own ``build_all_requests`` (as ``evaluate`` builds them; zero-shot, the seeded subsample of
kiln.evaluation.standard.prepare) and every side is timed on them, ``--repeats`` times, the order of the sides reversed
on every other repeat; times are the mean over repeats. Before timing, every side answers a few requests untimed.

Run: ``python bench/bench_eval_speed.py --gguf FILE`` (or ``--hf FOLDER``, or ``--tiny`` for a random tiny llama that
only proves the bench runs); ``--limit N`` items per benchmark (a group at least two per subtask); ``--tasks`` defaults
to hellaswag, arc_easy, piqa, winogrande, mmlu. Writes OUT.md and OUT.json (default bench/results/eval_speed) with the
command, commit, date and machine line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from provenance import header, header_md, machine_line  # noqa: E402

TASKS = "hellaswag,arc_easy,piqa,winogrande,mmlu"
SIDES = ("hf", "kiln", "kiln_noshare")
WARMUP = 8  # requests each side answers untimed before the first timing


def loglikelihood_requests(prepared, seed: int) -> tuple[list, int]:
    """lm-eval's loglikelihood Instances of the prepared benchmark (all its tasks, in lm-eval's order) and its items,
    built as lm_eval.evaluator.evaluate builds them, with the task settings kiln's evaluate_lm gives."""
    from kiln.evaluation.standard.run import _env, load_tasks

    loaded = load_tasks(prepared)
    reqs, items = [], 0
    with _env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1"):
        for name, task in loaded["tasks"].items():
            if task.get_config("num_fewshot") is None:
                task.set_config(key="num_fewshot", value=0)
            task.set_fewshot_seed(seed=seed)
            samples = prepared.samples.get(name) if prepared.samples is not None else None
            task.build_all_requests(samples=samples, rank=0, world_size=1)
            got = [i for i in task.instances if i.request_type == "loglikelihood"]
            reqs += [r for r in got for _ in range(r.repeats)]
            items += len({i.doc_id for i in got})
    return reqs, items


def time_side(lm, reqs: list, share: bool | None) -> tuple[float, float, list]:
    """(wall seconds, this process's CPU seconds, answers) of one ``loglikelihood`` call."""
    if share is not None:
        lm.share_context = share
    t0, c0 = time.perf_counter(), time.process_time()
    out = lm.loglikelihood(reqs)
    return time.perf_counter() - t0, time.process_time() - c0, [(float(a), bool(b)) for a, b in out]


def fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[dict]) -> list[str]:
    out = ["| task | items | requests | HFLM s | Kiln s | Kiln no-share s | HFLM req/s | Kiln req/s | Kiln no-share "
           "req/s | Kiln / HFLM | Kiln / no-share | Kiln no-share / HFLM | max abs d loglik Kiln-HFLM | "
           "max abs d loglik no-share-HFLM | greedy differ (Kiln, no-share) | HFLM CPU s | Kiln CPU s | Kiln no-share "
           "CPU s | Kiln / HFLM (CPU) | Kiln / no-share (CPU) |",
           "|" + "---|" * 20]
    for r in rows:
        out.append(f"| {r['task']} | {r['items']} | {r['requests']} | {r['hf_s']:.1f} | {r['kiln_s']:.1f} | "
                   f"{r['kiln_noshare_s']:.1f} | {r['hf_rps']:.1f} | {r['kiln_rps']:.1f} | "
                   f"{r['kiln_noshare_rps']:.1f} | "
                   f"**{r['speedup_vs_hf']:.2f}x** | {r['speedup_sharing']:.2f}x | {r['noshare_vs_hf']:.2f}x | "
                   f"{fmt(r['max_dloglik_kiln_hf'], '.2e')} | {fmt(r['max_dloglik_noshare_hf'], '.2e')} | "
                   f"{r['greedy_differ_kiln']}, {r['greedy_differ_noshare']} | {r['hf_cpu_s']:.1f} | "
                   f"{r['kiln_cpu_s']:.1f} | {r['kiln_noshare_cpu_s']:.1f} | {r['speedup_vs_hf_cpu']:.2f}x | "
                   f"{r['speedup_sharing_cpu']:.2f}x |")
    return out


def ratios(row: dict) -> None:
    """Speed-ups from a row's mean seconds (wall and CPU)."""
    for tag in ("", "_cpu"):
        s = {side: max(row[f"{side}{tag}_s"], 1e-9) for side in SIDES}
        row[f"speedup_vs_hf{tag}"] = round(s["hf"] / s["kiln"], 3)
        row[f"speedup_sharing{tag}"] = round(s["kiln_noshare"] / s["kiln"], 3)
        row[f"noshare_vs_hf{tag}"] = round(s["hf"] / s["kiln_noshare"], 3)


def summarise(task: str, items: int, reqs: list, secs: dict[str, list[float]], cpu: dict[str, list[float]],
              outs: dict[str, list]) -> dict:
    n = len(reqs)
    row = {"task": task, "items": items, "requests": n}
    for s in SIDES:
        row[f"{s}_s"] = round(sum(secs[s]) / len(secs[s]), 3)
        row[f"{s}_s_per_repeat"] = [round(v, 3) for v in secs[s]]
        row[f"{s}_rps"] = round(n / max(row[f"{s}_s"], 1e-9), 2)
        row[f"{s}_cpu_s"] = round(sum(cpu[s]) / len(cpu[s]), 3)
        row[f"{s}_cpu_s_per_repeat"] = [round(v, 3) for v in cpu[s]]
    ratios(row)

    def dmax(a: str, b: str):
        d = [abs(x[0] - y[0]) for x, y in zip(outs[a], outs[b])]
        return max(d) if d else None

    row["max_dloglik_kiln_hf"] = dmax("kiln", "hf")
    row["max_dloglik_noshare_hf"] = dmax("kiln_noshare", "hf")
    row["max_dloglik_kiln_noshare"] = dmax("kiln", "kiln_noshare")
    row["max_abs_loglik"] = max((abs(x[0]) for x in outs["hf"]), default=None)
    row["greedy_differ_kiln"] = sum(x[1] != y[1] for x, y in zip(outs["kiln"], outs["hf"]))
    row["greedy_differ_noshare"] = sum(x[1] != y[1] for x, y in zip(outs["kiln_noshare"], outs["hf"]))
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", help="a Hugging Face model folder")
    src.add_argument("--gguf", help="a GGUF file (both sides: transformers dequantises it, Kiln imports it)")
    src.add_argument("--tiny", action="store_true", help="a random tiny llama (proves the bench runs)")
    ap.add_argument("--tasks", default=TASKS, help=f"comma-separated benchmarks (default: {TASKS})")
    ap.add_argument("--limit", type=int, default=50, help="seeded items per benchmark (a group: >= 2 per subtask)")
    ap.add_argument("--repeats", type=int, default=2, help="timings per side; the side order reverses each repeat")
    ap.add_argument("--batch-size", type=int, default=16, help="both sides' batch_size")
    ap.add_argument("--max-length", type=int, default=None, help="context length of both sides (default: the model's)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cache", default=str(ROOT / ".kiln" / "storage" / "cache" / "sources"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "eval_speed"))
    args = ap.parse_args(argv)
    print(f"machine: {machine_line()}", flush=True)
    load0 = os.getloadavg()[0]

    import torch

    from kiln.evaluation.registry import REGISTRY
    from kiln.evaluation.standard.parity import hf_lm, kiln_lm, save_tiny_llama
    from kiln.evaluation.standard.run import fitting_limit, prepare

    if args.threads:
        torch.set_num_threads(args.threads)
    benches = [REGISTRY.benchmark(n) for n in args.tasks.split(",") if n]
    work = Path(tempfile.mkdtemp(prefix="kiln-eval-speed-"))
    work_reqs = []
    for b in benches:
        p = prepare([b.name], args.cache, work / "tasks" / b.name, limit=fitting_limit(b, args.limit), seed=args.seed)
        reqs, items = loglikelihood_requests(p, args.seed)
        work_reqs.append((b.name, items, reqs))
        print(f"{b.name}: {items} items, {len(reqs)} loglikelihood requests", flush=True)
    model = (save_tiny_llama(work / "tiny", positions=args.max_length or 512) if args.tiny
             else Path(args.gguf or args.hf))
    t0 = time.perf_counter()
    hf = hf_lm(model, args.batch_size, args.max_length, args.device)
    kiln = kiln_lm(model, work / "kiln", args.batch_size, args.max_length, args.device)
    print(f"models loaded in {time.perf_counter() - t0:.1f}s: {model}; torch threads {torch.get_num_threads()}",
          flush=True)
    sides = {"hf": (hf, None), "kiln": (kiln, True), "kiln_noshare": (kiln, False)}
    first = work_reqs[0][2][:WARMUP]
    for lm, share in sides.values():
        time_side(lm, first, share)
    rows = []
    for name, items, reqs in work_reqs:
        secs: dict[str, list[float]] = {s: [] for s in SIDES}
        cpu: dict[str, list[float]] = {s: [] for s in SIDES}
        outs: dict[str, list] = {}
        for r in range(args.repeats):
            for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                lm, share = sides[side]
                s, c, out = time_side(lm, reqs, share)
                secs[side].append(s)
                cpu[side].append(c)
                if side in outs and out != outs[side]:
                    d = max(abs(a[0] - b[0]) for a, b in zip(out, outs[side]))
                    print(f"  note: {side} repeat {r + 1} differs from repeat 1 by up to {d:.2e}", flush=True)
                outs.setdefault(side, out)
                print(f"  {name} repeat {r + 1} {side}: {s:.2f}s (CPU {c:.2f}s)", flush=True)
        row = summarise(name, items, reqs, secs, cpu, outs)
        rows.append(row)
        print(table([row])[2], flush=True)
    total = {"task": "all", "items": sum(r["items"] for r in rows), "requests": sum(r["requests"] for r in rows)}
    for s in SIDES:
        for tag in ("", "_cpu"):
            per = [sum(r[f"{s}{tag}_s_per_repeat"][k] for r in rows) for k in range(args.repeats)]
            total[f"{s}{tag}_s"] = round(sum(per) / len(per), 3)
            total[f"{s}{tag}_s_per_repeat"] = [round(v, 3) for v in per]
        total[f"{s}_rps"] = round(total["requests"] / max(total[f"{s}_s"], 1e-9), 2)
    ratios(total)
    for key in ("max_dloglik_kiln_hf", "max_dloglik_noshare_hf", "max_dloglik_kiln_noshare", "max_abs_loglik"):
        vals = [r[key] for r in rows if r[key] is not None]
        total[key] = max(vals) if vals else None
    total["greedy_differ_kiln"] = sum(r["greedy_differ_kiln"] for r in rows)
    total["greedy_differ_noshare"] = sum(r["greedy_differ_noshare"] for r in rows)
    rows.append(total)
    target = 1.5
    verdict = (f"target {target}x: {'met' if total['speedup_vs_hf'] >= target else 'MISSED'} "
               f"(Kiln / HFLM over all requests, wall time: {total['speedup_vs_hf']:.2f}x; CPU time: "
               f"{total['speedup_vs_hf_cpu']:.2f}x)")
    print("\n".join(table(rows)), flush=True)
    print(verdict, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    name = "a random tiny llama (kiln.evaluation.standard.parity.save_tiny_llama)" if args.tiny else model
    about = (f"Model: {name}; both sides float32 on {args.device}, batch size {args.batch_size}, max length "
             f"{args.max_length or 'the model’s'}, torch threads {torch.get_num_threads()}; seed {args.seed}; "
             f"{args.limit} seeded items per benchmark (mmlu: at least 2 per subtask), zero-shot. Seconds are one "
             f"``loglikelihood`` call on the benchmark's whole request list (lm-eval's own Instances, identical for "
             f"all sides), the mean of {args.repeats} repeats with the side order reversed on every other repeat; "
             f"requests/s = requests / that mean. Kiln / HFLM is HFLM's seconds over Kiln's (higher: Kiln faster); "
             f"Kiln / no-share is the speed-up of the shared path alone (the same KilnLM with share_context off). "
             f"CPU s: this process's CPU time in the same calls (time.process_time), the work itself where other "
             f"jobs share the cores (wall time then waits for a core as well). d loglik: largest |difference| of one "
             f"request's log-likelihood (float32 sums; spacing at 512 is 6.1e-5). Load average (1 min) at start "
             f"{load0:.2f}, at end {os.getloadavg()[0]:.2f}.")
    per_repeat = "; ".join(
        f"repeat {k + 1}: HFLM {total['hf_s_per_repeat'][k]:.1f}s, Kiln {total['kiln_s_per_repeat'][k]:.1f}s, "
        f"no-share {total['kiln_noshare_s_per_repeat'][k]:.1f}s, Kiln / HFLM "
        f"{total['hf_s_per_repeat'][k] / max(total['kiln_s_per_repeat'][k], 1e-9):.2f}x" for k in range(args.repeats))
    lines = ["# Evaluation speed: Kiln's adapter against lm-eval's HFLM", "", *header_md(), about, "", *table(rows), "",
             f"All tasks, {per_repeat}.", "", verdict, ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    out.with_suffix(".json").write_text(json.dumps({**header(), "model": str(model), "args": vars(args),
                                                    "load_average_start_end": [load0, os.getloadavg()[0]],
                                                    "target": target, "verdict": verdict, "rows": rows}, indent=2))
    print(f"wrote {out.with_suffix('.md')} and .json")
    return rows


if __name__ == "__main__":
    main()
