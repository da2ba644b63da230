"""Benchmark, side by side in one run: a step over preference pairs with every row in one padded batch against the
rows run in groups of similar length (kiln.posttrain.logprobs.grouped_sequence_logps), as DPO's step and RL's
replayed pairs take them.

python bench/bench_pair_groups.py --preferences FILE --tokenizer FILE [--pairs 16 8] [--steps 30] [--out STEM]

FILE: a preference_data pairs file and its tokenizer, e.g. the demo's ``.kiln/storage/preference_data/<version>/
preferences.jsonl`` and ``.kiln/storage/tokenizer/<version>/tokenizer.json`` after ``make demo``; their rows' lengths
are what the comparison is about. The model is the demo's shape (llama, 4 x 256) with random weights (the weights do
not change the work). Each step draws ``--pairs`` training pairs (seeded), computes the reference's summed log-probs
(no gradient) and the policy's, and takes DPO's loss and its backward: once with one batch, once grouped, alternating
so that both see the same machine. Printed and written: the median ms per step of each, their ratio, the padded
tokens each runs per step, and the largest difference between the two ways' losses.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kiln.model.config import MODEL_PRESETS, ModelConfig  # noqa: E402
from kiln.model.families import build_model  # noqa: E402
from kiln.posttrain.common import read_jsonl_split  # noqa: E402
from kiln.posttrain.dpo import dpo_loss, encode_preferences, pair_batch  # noqa: E402
from kiln.posttrain.logprobs import (length_groups, model_sequence_logps, model_token_logps,  # noqa: E402
                                     target_lengths)
from kiln.tokens.tokenizer import load_encoding  # noqa: E402
from provenance import machine_line, write_results  # noqa: E402


def step(policy, ref, x, y, grouped: bool) -> tuple[float, float]:
    """One DPO step's log-probs, loss and backward on pairs x, y (2B, T): (seconds, loss). Grouped is what DPO runs
    (model_sequence_logps); one batch is the same sums without the grouping."""
    sums = model_sequence_logps if grouped else lambda model, a, b: model_token_logps(model, a, b).sum(-1)

    t0 = time.perf_counter()
    with torch.no_grad():
        r = sums(ref, x, y)
    p = sums(policy, x, y)
    m = x.size(0) // 2
    loss, _, _ = dpo_loss(p[:m], p[m:], r[:m], r[m:], 0.1)
    loss.backward()
    seconds = time.perf_counter() - t0
    policy.zero_grad(set_to_none=True)
    return seconds, float(loss.detach())


def padded_tokens(y: torch.Tensor) -> tuple[int, int]:
    """Tokens one batch runs, and the grouped passes run, for targets y (2B, T)."""
    last = target_lengths(y)
    return y.numel(), sum(len(g) * last[g[-1]] for g in length_groups(last))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preferences", required=True, help="a preference_data pairs file (preferences.jsonl)")
    p.add_argument("--tokenizer", required=True, help="the tokenizer.json the pairs are encoded with")
    p.add_argument("--pairs", type=int, nargs="+", default=[16, 8], help="pairs per step (DPO's micro_batch 16, "
                   "RL's replayed 8 on the demo)")
    p.add_argument("--steps", type=int, default=30, help="timed steps of each way, per pairs setting")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="write STEM.md and STEM.json (command, commit, date, machine inside)")
    a = p.parse_args()
    print(f"machine: {machine_line()}", flush=True)

    enc = load_encoding(a.tokenizer)
    rows = read_jsonl_split(a.preferences, "train")
    if not rows:
        sys.exit(f"{a.preferences}: no training pairs; pass the pairs file preference_data wrote")
    tokens, mask = encode_preferences(enc, rows, a.seq_len)
    cfg = ModelConfig(**{"family": "llama", **MODEL_PRESETS["llama"]["demo"], "vocab_size": enc.n_vocab})
    torch.manual_seed(a.seed)
    policy, ref = build_model(cfg), build_model(cfg).eval()
    rng = np.random.default_rng(a.seed)
    results, lines = [], []
    for pairs in a.pairs:
        one_s, grouped_s, gaps, padded = [], [], [], []
        for i in range(a.steps + 1):  # the first of each is a warm-up
            idx = rng.choice(len(rows), size=min(pairs, len(rows)), replace=False)
            x, y = pair_batch(tokens[idx], mask[idx])
            (s1, l1), (s2, l2) = ((step(policy, ref, x, y, False), step(policy, ref, x, y, True)) if i % 2 else
                                  reversed((step(policy, ref, x, y, True), step(policy, ref, x, y, False))))
            if i:
                one_s.append(s1)
                grouped_s.append(s2)
                gaps.append(abs(l1 - l2))
                padded.append(padded_tokens(y))
        r = {"pairs": pairs, "steps": a.steps, "one_batch_ms": 1e3 * statistics.median(one_s),
             "grouped_ms": 1e3 * statistics.median(grouped_s),
             "one_batch_tokens": statistics.mean(t for t, _ in padded),
             "grouped_tokens": statistics.mean(g for _, g in padded),
             "max_loss_difference": max(gaps)}
        r["speedup"] = r["one_batch_ms"] / r["grouped_ms"]
        results.append(r)
        line = (f"| {pairs} | {r['one_batch_ms']:.0f} | {r['grouped_ms']:.0f} | **{r['speedup']:.2f}x** | "
                f"{r['one_batch_tokens']:,.0f} | {r['grouped_tokens']:,.0f} | {r['max_loss_difference']:.1e} |")
        print(line, flush=True)
        lines.append(line)
    about = (f"{len(rows)} training pairs of `{a.preferences}`, {a.steps} timed steps of each way per row (median), "
             f"seed {a.seed}; model: the demo's shape ({cfg.n_layer} x {cfg.n_embd}, vocabulary {cfg.vocab_size}), "
             "random weights; a step is the reference's sums (no gradient), the policy's, DPO's loss and its "
             "backward.")
    table = ["| pairs per step | one batch, ms | grouped by length, ms | speed-up | tokens run, one batch | "
             "tokens run, grouped | largest loss difference |", "|---:|---:|---:|---:|---:|---:|---:|", *lines]
    print(about)
    if a.out:
        write_results(a.out, "Preference pairs: one padded batch against rows grouped by length", [about, "", *table],
                      {"results": results, "preferences": a.preferences, "tokenizer": a.tokenizer})


if __name__ == "__main__":
    main()
