"""Tokens each evaluation path runs through the model, padding and re-run context tails included, against the fewest
it could: HFLM, Kiln's shared-context path and Kiln's one-row path on the same lm-eval requests.

    python bench/eval_tokens.py --gguf <SmolLM2 GGUF> --seed 1234 --out bench/results/eval_tokens_seed1234

Per benchmark and side: sum of batch rows x positions over the model's forward calls (counted by a forward
pre-hook), the number of calls, and that sum over the ideal: for HFLM and the one-row path, the distinct rows
ctx + cont[:-1] each run once without padding; for the shared path, each distinct context once plus each distinct
ending input once. Both models are cut to their first block (the batching depends on token lengths only), so the
run takes a minute; seconds are not reported. Where evaluation time goes once the vocabulary head runs only at scored
positions: compute is close to proportional to these tokens (bench/bench_eval_speed.py measures the time).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_eval_speed import TASKS, loglikelihood_requests  # noqa: E402
from provenance import header, header_md, machine_line  # noqa: E402


def ideal(lm, reqs: list) -> tuple[int, int]:
    """(tokens of the distinct rows, tokens of the distinct contexts plus distinct ending inputs), as KilnLM splits
    a request (trailing spaces of the context go to the continuation)."""
    pairs = []
    for r in reqs:
        ctx, cont = r.args
        n_sp = len(ctx) - len(ctx.rstrip())
        if n_sp:
            ctx, cont = ctx[:-n_sp], ctx[-n_sp:] + cont
        pairs.append((tuple(lm._encode(ctx)) if ctx else (lm.eot,), tuple(lm._encode(cont))))
    rows = {c + e[:-1] for c, e in pairs}
    ends = {(c, e[:-1]) for c, e in pairs}
    return sum(map(len, rows)), sum(len(c) for c in {c for c, _ in pairs}) + sum(len(e) for _, e in ends)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, help="a GGUF file (both sides: transformers dequantises it, Kiln imports it)")
    ap.add_argument("--tasks", default=TASKS)
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--cache", default=str(ROOT / ".kiln" / "storage" / "cache" / "sources"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "eval_tokens"))
    args = ap.parse_args(argv)
    print(f"machine: {machine_line()}", flush=True)
    import torch

    from kiln.evaluation.registry import REGISTRY
    from kiln.evaluation.standard.parity import hf_lm, kiln_lm
    from kiln.evaluation.standard.run import fitting_limit, prepare

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="kiln-eval-tokens-"))
    hf = hf_lm(Path(args.gguf), args.batch_size, args.max_length, "cpu")
    kiln = kiln_lm(Path(args.gguf), work / "kiln", args.batch_size, args.max_length, "cpu")
    hf._model.model.layers = hf._model.model.layers[:1]  # one block: the same calls, a thirtieth of the work
    hf._model.config.num_hidden_layers = 1
    kiln.model.model.layers = kiln.model.model.layers[:1]
    kiln.model.config.n_layer = 1
    seen = {"tokens": 0, "calls": 0}

    def count(module, a, kw):
        x = a[0] if a else kw["input_ids"]
        seen["tokens"] += x.shape[0] * x.shape[1]
        seen["calls"] += 1

    hf._model.register_forward_pre_hook(count, with_kwargs=True)
    kiln.model.register_forward_pre_hook(count, with_kwargs=True)
    rows = []
    for name in args.tasks.split(","):
        bench = REGISTRY.benchmark(name)
        prepared = prepare([name], args.cache, work / "tasks" / name, limit=fitting_limit(bench, args.limit),
                           seed=args.seed)
        reqs, items = loglikelihood_requests(prepared, args.seed)
        best_rows, best_shared = ideal(kiln, reqs)
        row = {"task": name, "items": items, "requests": len(reqs), "ideal_rows": best_rows,
               "ideal_shared": best_shared}
        for side, lm, share in (("hf", hf, None), ("kiln", kiln, True), ("kiln_noshare", kiln, False)):
            if share is not None:
                lm.share_context = share
            seen.update(tokens=0, calls=0)
            lm.loglikelihood(reqs)
            best = best_shared if side == "kiln" else best_rows
            row.update({f"{side}_tokens": seen["tokens"], f"{side}_calls": seen["calls"],
                        f"{side}_over_ideal": round(seen["tokens"] / best, 3)})
        rows.append(row)
        print(json.dumps(row), flush=True)
    total = {"task": "all", **{k: sum(r[k] for r in rows) for k in rows[0] if k != "task"}}
    for side, best in (("hf", "ideal_rows"), ("kiln", "ideal_shared"), ("kiln_noshare", "ideal_rows")):
        total[f"{side}_over_ideal"] = round(total[f"{side}_tokens"] / total[best], 3)
    rows.append(total)
    cols = ["task", "requests", "ideal_rows", "ideal_shared", "hf_tokens", "hf_calls", "hf_over_ideal",
            "kiln_tokens", "kiln_calls", "kiln_over_ideal", "kiln_noshare_tokens", "kiln_noshare_calls",
            "kiln_noshare_over_ideal"]
    table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    table += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    about = (f"Model: {args.gguf}, cut to its first block on both sides; batch size {args.batch_size}, max length "
             f"{args.max_length}; seed {args.seed}; {args.limit} seeded items per benchmark, zero-shot. Tokens: sum "
             "over forward calls of batch rows x positions; over_ideal: tokens / the fewest (ideal_rows for HFLM and "
             "the one-row path, ideal_shared for the shared path).")
    out.with_suffix(".md").write_text("\n".join(["# Tokens run per evaluation path", "", *header_md(), about, "",
                                                  *table, ""]))
    out.with_suffix(".json").write_text(json.dumps({**header(), "args": vars(args), "rows": rows}, indent=2))
    print("\n".join(table))
    print(f"wrote {out.with_suffix('.md')} and .json")
    return rows


if __name__ == "__main__":
    main()
