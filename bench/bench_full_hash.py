"""What hashing every token shard in full costs before a training launch (resources.torchrun.TrainingLaunch.
verify_shards), beside the quick check the loader makes on every start (a stat per shard remembered as hashed).

Run: ``python bench/bench_full_hash.py [--sizes-mb 16 128 512] [--out bench/results/full_hash]``. Writes shards of
random tokens in the llm.c format (10M-token shards, the token_shards default) into a temporary folder, then times
kiln.tokens.shards.check_shard_files with full=True (sha256 of every byte, read from the page cache as a launch right after
token_shards reads them) and without (the quick check), twice each; and sha256 of the same bytes in one call as the
raw library's rate. Prints the machine line first; writes OUT.md and OUT.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kiln.tokens.shards import MANIFEST, _write_shard, check_shard_files  # noqa: E402
from provenance import header, header_md, machine_line  # noqa: E402

SHARD_TOKENS = 10_000_000  # the token_shards asset's default shard size


def make_shards(folder: Path, megabytes: int, seed: int = 0) -> list[Path]:
    """uint16 shards holding ``megabytes`` MB of tokens in all, with the manifest verify_shards reads."""
    rng = np.random.default_rng(seed)
    left, shards, paths = megabytes * 10**6 // 2, [], []
    while left > 0:
        n = min(SHARD_TOKENS, left)
        name = f"train_{len(shards):06d}.bin"
        entry = _write_shard(folder / name, rng.integers(1, 4096, n, dtype=np.uint16), np.dtype("<u2"), 0)
        shards.append({"file": name, "split": "train", **entry})
        paths.append(folder / name)
        left -= n
    (folder / MANIFEST).write_text(json.dumps({"format": "llm.c", "dtype": "uint16", "vocab_size": 4096,
                                               "shards": shards}))
    return paths


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def raw_sha256(paths: list[Path]) -> None:
    for p in paths:
        hashlib.sha256(p.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[16, 128, 512])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "full_hash"))
    args = ap.parse_args(argv)
    print(f"machine: {machine_line()}", flush=True)
    rows = []
    for mb in args.sizes_mb:
        with tempfile.TemporaryDirectory() as tmp:
            paths = make_shards(Path(tmp), mb)
            nbytes = sum(p.stat().st_size for p in paths)
            check_shard_files(paths)  # remembered as hashed: what the loader's quick check then finds
            row = {"mb": round(nbytes / 1e6, 1), "shards": len(paths),
                   "full_s": [round(timed(lambda: check_shard_files(paths, full=True)), 4) for _ in range(2)],
                   "quick_s": [round(timed(lambda: check_shard_files(paths)), 4) for _ in range(2)],
                   "raw_sha256_s": [round(timed(lambda: raw_sha256(paths)), 4) for _ in range(2)]}
            row["full_s_per_gb"] = [round(s / (nbytes / 1e9), 3) for s in row["full_s"]]
            row["full_vs_raw"] = [round(f / r, 2) for f, r in zip(row["full_s"], row["raw_sha256_s"])]
            print(json.dumps(row), flush=True)
            rows.append(row)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({**header(argv if argv is not None else sys.argv), "rows": rows},
                                                   indent=2) + "\n")
    lines = ["# Full sha256 of the token shards before a launch, beside the quick check", "",
             *header_md(argv if argv is not None else sys.argv),
             "Shards of random uint16 tokens (10M tokens, 20 MB each), in the page cache. Two runs of each, in one "
             "process, one after the other.", "",
             "| MB | shards | full hash s | s per GB | quick check s | raw sha256 s | full / raw |",
             "|---:|---:|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mb']:,} | {r['shards']} | {', '.join(map(str, r['full_s']))} | "
                     f"{', '.join(map(str, r['full_s_per_gb']))} | {', '.join(map(str, r['quick_s']))} | "
                     f"{', '.join(map(str, r['raw_sha256_s']))} | {', '.join(map(str, r['full_vs_raw']))} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
