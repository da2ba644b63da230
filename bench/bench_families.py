"""Benchmark, side by side in one run: GPT-2 and llama at (nearly) equal parameter count on the same token shards.

python bench/bench_families.py --shards DIR [--steps 150] [--threads 1] [--json out.json]
DIR is a token_shards folder (train_*.bin, val_*.bin, manifest.json): a demo home's `.kiln/storage/token_shards/<v>`
(`kiln run --preset demo --select token_shards`), or the smoke preset's (`kiln run --preset smoke --select
token_shards --home H`). Both models train the same steps on the same batches in the same order (same seed, optimizer
and schedule) with Kiln's model code and optimizer; the llama's SwiGLU width is chosen so its parameter count is
closest to GPT-2's. Reported: validation loss at equal tokens (the end of the budget), at equal wall time (the
slower model's curve read at the faster one's total training time), and training tokens/s. Validation time is not
counted as training time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln.tokens.loader import TokenLoader, iter_eval_batches  # noqa: E402
from kiln.model.config import ModelConfig, padded_vocab  # noqa: E402
from kiln.model.families import build_model, flops_per_token  # noqa: E402
from kiln.model.parallel import clip_grad_norm  # noqa: E402
from kiln.plan.memory import count_params  # noqa: E402
from kiln.tokens.shards import shard_paths  # noqa: E402
from kiln.train.optim import OptimConfig, make_optimizer, make_scheduler  # noqa: E402


def configs(vocab: int, n_layer: int, n_embd: int, n_head: int, n_kv_head: int, block: int) -> list[ModelConfig]:
    """GPT-2 of this shape, and a llama of the same depth and width whose SwiGLU width (a multiple of 32) brings
    its total parameter count closest to GPT-2's."""
    gpt = ModelConfig(vocab_size=vocab, block_size=block, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    target = count_params(gpt)[0]

    def llama(i: int) -> ModelConfig:
        return ModelConfig(family="llama", vocab_size=vocab, block_size=block, n_layer=n_layer, n_head=n_head,
                           n_kv_head=n_kv_head, n_embd=n_embd, intermediate_size=i)

    best = min(range(32, 16 * n_embd, 32), key=lambda i: abs(count_params(llama(i))[0] - target))
    return [gpt, llama(best)]


@torch.no_grad()
def val_loss(model: torch.nn.Module, files: list, batch: int, seq_len: int, batches: int) -> float:
    model.eval()
    losses = [model(x, y).item() for x, y in iter_eval_batches(files, batch, seq_len, batches)]
    model.train()
    return float(np.mean(losses))


def train(cfg: ModelConfig, shards: Path, a: argparse.Namespace) -> dict:
    """Train ``cfg`` for ``a.steps`` steps; the curve is (step, tokens, training seconds, val loss) every eval."""
    torch.manual_seed(0)
    model = build_model(cfg)
    opt_cfg = OptimConfig(name=a.optim, lr=a.lr, warmup_steps=a.warmup, schedule=a.schedule)
    optimizer = make_optimizer(model, opt_cfg, torch.device("cpu"))
    scheduler = make_scheduler(optimizer, opt_cfg, a.steps)
    loader = TokenLoader(shard_paths(shards, "train"), a.batch, a.seq_len, seed=0)
    val = shard_paths(shards, "val")
    tokens_per_step = a.batch * a.seq_len
    curve = [(0, 0, 0.0, val_loss(model, val, a.batch, a.seq_len, a.eval_batches))]
    train_s = 0.0
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        x, y = loader.next_batch()  # (B, T) each
        model(x, y).backward()
        clip_grad_norm(model, opt_cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        train_s += time.perf_counter() - t0
        if step % a.eval_every == 0 or step == a.steps:
            curve.append((step, step * tokens_per_step, train_s, val_loss(model, val, a.batch, a.seq_len, a.eval_batches)))
    return {"family": cfg.family, "params": count_params(cfg)[0], "params_non_embedding": count_params(cfg)[1],
            "model": {k: v for k, v in cfg.__dict__.items()}, "flops_per_token": flops_per_token(cfg, a.seq_len),
            "train_s": train_s, "tokens": a.steps * tokens_per_step, "tokens_per_s": a.steps * tokens_per_step / train_s,
            "final_val_loss": curve[-1][3], "curve": curve}


def loss_at_time(curve: list, seconds: float) -> float:
    """Validation loss read off a curve at ``seconds`` of training (linear between evaluations)."""
    times, losses = [c[2] for c in curve], [c[3] for c in curve]
    return float(np.interp(seconds, times, losses))


def compare(runs: list[dict]) -> dict:
    """Equal tokens: each final loss. Equal time: each curve read at the faster model's total training time."""
    budget = min(r["train_s"] for r in runs)
    for r in runs:
        r["val_loss_at_equal_time"] = loss_at_time(r["curve"], budget)
    return {"equal_time_s": budget, "runs": runs}


def table(result: dict, tokens: int) -> str:
    rows = [f"{'family':<7} {'params':>9} {'non-emb':>9} {'tok/s':>8} {'train s':>8} "
            f"{'val@' + format(tokens, ',') + ' tok':>16} {'val@' + format(result['equal_time_s'], '.1f') + ' s':>10}"]
    for r in result["runs"]:
        rows.append(f"{r['family']:<7} {r['params']:>9,} {r['params_non_embedding']:>9,} {r['tokens_per_s']:>8,.0f} "
                    f"{r['train_s']:>8.1f} {r['final_val_loss']:>16.4f} {r['val_loss_at_equal_time']:>10.4f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", required=True, help="a token_shards folder (train_*.bin, val_*.bin, manifest.json)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-kv-head", type=int, default=2, help="llama's key/value heads (grouped-query attention)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=150, help="the token budget is steps x batch x seq_len")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--optim", default="adamw", help="adamw, or muon (Muon on the blocks' matrices, AdamW on the rest)")
    p.add_argument("--schedule", default="cosine", help="cosine or wsd (warmup-stable-decay)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="1 on a shared machine: two threads on busy cores run several times slower")
    p.add_argument("--json", default="", help="also write the results to this file")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    shards = Path(a.shards)
    manifest = json.loads((shards / "manifest.json").read_text())
    vocab = padded_vocab(manifest["vocab_size"])
    cfgs = configs(vocab, a.n_layer, a.n_embd, a.n_head, a.n_kv_head, a.seq_len)
    result = compare([train(cfg, shards, a) for cfg in cfgs])
    tokens = a.steps * a.batch * a.seq_len
    result.update(shards=str(shards), encoding=manifest.get("encoding"), train_tokens=manifest["splits"]["train"]["tokens"],
                  token_budget=tokens, epochs=tokens / manifest["splits"]["train"]["tokens"], threads=a.threads,
                  settings={k: v for k, v in vars(a).items() if k not in ("json", "shards")})
    print(f"{shards} ({manifest.get('encoding')}, {result['train_tokens']:,} train tokens): {tokens:,} tokens each "
          f"({result['epochs']:.2f} epochs), {a.steps} steps of {a.batch} x {a.seq_len}, {a.threads} threads")
    print(table(result, tokens))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
