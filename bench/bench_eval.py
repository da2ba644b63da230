"""Benchmark, side by side in one run: the lm-eval adapter's loglikelihood requests/s vs raw forward passes of the same model.

Run: python bench/bench_eval.py [--requests 256] [--repeat 3] [--threads N]   (target: adapter time <= 1.3 x raw forward time)
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from kiln.evaluation.adapter import KilnLM  # noqa: E402
from kiln.model.config import ModelConfig  # noqa: E402
from kiln.model.config import padded_vocab  # noqa: E402
from kiln.model.families import build_model  # noqa: E402
from kiln.tokens.tokenizer import train_bpe  # noqa: E402

TARGET = 1.3  # the adapter may take at most 30% longer than raw forward passes over the same tokens


def english() -> list[str]:
    """Paragraphs of CPython's pydoc topics (shipped with Python): real English prose, no download."""
    from pydoc_data.topics import topics

    paras = [" ".join(p.split()) for t in topics.values() for p in t.split("\n\n")]
    return [p for p in paras if len(p.split()) >= 40]


def requests(paras: list[str], n: int, seed: int) -> list[Instance]:
    """HellaSwag-shaped requests: a 30-90 word context and a 6-20 word continuation, all distinct."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = rng.choice(paras).split()
        k, m = rng.randint(30, min(90, len(words) - 6)), rng.randint(6, 20)
        out.append(Instance("loglikelihood", {}, (" ".join(words[:k]), " " + " ".join(words[k : k + m])), i))
    return out


def timed(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    paras = english()
    enc = train_bpe(paras, 4096)
    cfg = ModelConfig(vocab_size=padded_vocab(enc.n_vocab), block_size=256, n_layer=4, n_head=4, n_embd=256)  # the demo model
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    lm = KilnLM(model, enc, batch_size=args.batch_size)
    reqs = requests(paras, args.requests, seed=0)

    # The batches the adapter forms (same rows, same length-sorted padding), and the same real tokens packed densely.
    rows = [r for req in reqs for r in lm._rows(lm._encode(req.args[0]), lm._encode(req.args[1]))]
    rows.sort(key=lambda r: -len(r[0]))
    padded, s = [], 0
    while s < len(rows):  # the adapter's rule: batch_size x block_size input tokens per pass
        chunk = rows[s : s + max(1, args.batch_size * cfg.block_size // len(rows[s][0]))]
        padded.append(torch.tensor([r[0] + [0] * (len(chunk[0][0]) - len(r[0])) for r in chunk]))  # (B, T)
        s += len(chunk)
    n_tok = sum(len(r[0]) for r in rows)
    flat = torch.randint(0, enc.n_vocab, (n_tok,))
    full = n_tok // cfg.block_size
    packed = [flat[: full * cfg.block_size].view(full, cfg.block_size)[s : s + args.batch_size]
              for s in range(0, full, args.batch_size)]  # (B, block) each
    if n_tok % cfg.block_size:
        packed.append(flat[full * cfg.block_size :].view(1, -1))

    def forward(batches):
        with torch.inference_mode():
            for x in batches:
                model(x)

    lm.loglikelihood(reqs[:8])  # warm up kernels and allocator
    t_adapter = timed(lambda: lm.loglikelihood(reqs), args.repeat)
    t_padded = timed(lambda: forward(padded), args.repeat)
    t_packed = timed(lambda: forward(packed), args.repeat)

    mc = []  # MMLU-shaped: 4 one-token letters after the same question share one input row
    for i, req in enumerate(reqs[: args.requests // 4]):
        mc += [Instance("loglikelihood", {}, (req.args[0] + "\nAnswer:", f" {c}"), 4 * i + j) for j, c in enumerate("ABCD")]
    t_mc = timed(lambda: lm.loglikelihood(mc), args.repeat)

    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model: {params:.1f}M parameters (4 layers, width 256, block 256, vocab {cfg.vocab_size}); CPU threads: {args.threads}; "
          f"batch {args.batch_size}; best of {args.repeat}")
    print(f"{len(reqs)} HellaSwag-shaped requests, {n_tok:,} model input tokens ({n_tok / len(reqs):.0f} per request)")
    print(f"adapter loglikelihood:              {len(reqs) / t_adapter:8.1f} requests/s  {n_tok / t_adapter:9,.0f} tokens/s")
    print(f"raw forward, the adapter's batches: {len(reqs) / t_padded:8.1f} requests/s  {n_tok / t_padded:9,.0f} tokens/s  "
          f"adapter/raw time {t_adapter / t_padded:.2f}")
    print(f"raw forward, same tokens packed:    {len(reqs) / t_packed:8.1f} requests/s  {n_tok / t_packed:9,.0f} tokens/s  "
          f"adapter/raw time {t_adapter / t_packed:.2f} (target <= {TARGET})")
    print(f"MMLU-shaped, 4 one-token choices per question: {len(mc) / t_mc:8.1f} requests/s "
          f"({len(mc) // 4} questions, one forward row per question)")
    print("PASS" if t_adapter / t_packed <= TARGET else "OVER TARGET")


if __name__ == "__main__":
    main()
