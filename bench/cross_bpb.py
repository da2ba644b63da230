"""Bits per byte of base models from different Kiln homes on each other's held-out text.

Two homes that trained the same recipe on different corpora (say the demo, and the demo with more sources) have
different tokenizers and validation splits, so their own validation losses do not compare. This scores every base
model, each through its own tokenizer, on the raw bytes of every home's validation documents (decoded from its
token shards), one side-by-side matrix in one run:

    python bench/cross_bpb.py --home demo=.kiln --home more=/tmp/more/.kiln

A row is a model, a column the held-out text it is scored on; lower is better. Each home needs materialized
token_shards and base_model assets (the newest version of each is used).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kiln.tokens.shards import decode_documents, shard_paths  # noqa: E402
from kiln.train.checkpoint import load_for_inference  # noqa: E402


def newest(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"{folder}: nothing matches {pattern}; materialize token_shards and base_model there first")
    return found[-1]


def base_checkpoint(home: Path) -> Path:
    run = newest(home / "storage" / "base_model", "*/checkpoints")
    return sorted(run.glob("step_*"))[-1]


@torch.no_grad()
def bits_per_byte(model, enc, docs: list[str], window: int) -> tuple[float, int]:
    """Summed next-token loss over the documents (end-of-text between them) in windows of ``window`` tokens,
    over their UTF-8 bytes, in bits; and the token count."""
    ids: list[int] = []
    for d in docs:
        ids += [*enc.encode_ordinary(d), enc.eot_token]
    x = torch.tensor(ids)
    nll = 0.0
    for i in range(0, len(x) - 1, window):
        chunk = x[i : i + window + 1]
        if len(chunk) < 2:
            break
        logits = model(chunk[None, :-1])[0].float()
        nll += float(torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum"))
    return nll / sum(len(d.encode()) for d in docs) / math.log(2), len(ids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", action="append", required=True, metavar="NAME=PATH", help="a Kiln home (twice or more)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    homes = {}
    for spec in args.home:
        name, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"--home {spec!r}: write NAME=PATH")
        homes[name] = Path(path)
    models = {}
    texts = {}
    for name, home in homes.items():
        checkpoint = base_checkpoint(home)
        model, enc, _ = load_for_inference(str(checkpoint), "cpu")
        models[name] = (model.eval(), enc)
        texts[name] = decode_documents(enc, shard_paths(newest(home / "storage" / "token_shards", "*"), "val"))
        print(f"{name}: base model {checkpoint}; held-out text {len(texts[name])} documents, "
              f"{sum(len(d.encode()) for d in texts[name]):,} bytes", flush=True)
    width = max(len(n) for n in homes) + 2
    print(f"\nbits per byte (row: model, column: held-out text)\n{'':{width}s}" +
          "".join(f"{n:>{width + 6}s}" for n in texts))
    for name, (model, enc) in models.items():
        cells = [bits_per_byte(model, enc, docs, model.config.block_size)[0] for docs in texts.values()]
        print(f"{name:{width}s}" + "".join(f"{c:>{width + 6}.4f}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
