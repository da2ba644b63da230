"""Benchmark, side by side in one run: a dense llama and mixtures of experts with the same active parameters per token,
trained on the same token shards for the same tokens; and the mixture's load balance with and without balancing.

python bench/bench_moe.py --shards DIR [--seeds 0,1,2] [--steps 300] [--experts 8] [--top-k 2] [--out STEM]
DIR is a token_shards folder (train_*.bin, val_*.bin, manifest.json): a demo home's `.kiln/storage/token_shards/<v>`.

Every model has the same attention (llama's with QK-norm in the mixtures, as Qwen3-MoE; the dense model runs it too,
so the comparison is the MLP alone) and, within one seed, sees the same batches in the same order (optimizer and
schedule the same); each seed draws other initial weights and another batch order. The summary gives each model's
validation loss over the seeds (mean, min and max) and each mixture's difference from the dense model of the same
seed (mean and range), so a difference is read against the spread between seeds.
The dense SwiGLU is ``I`` wide; each mixture has ``--experts`` experts of I / k, k per token: equal active MLP
parameters per token, E / k times the MLP parameters in all. Mixtures: ``aux_loss`` (switch balance loss, weight
0.01), ``aux_free`` (DeepSeek-V3's bias, rate 0.001) and ``none`` (no balancing). Reported per model: total and
active parameters, training tokens/s (validation excluded), validation loss at the end (equal tokens), and for the
mixtures the load balance of the last 50 steps (max/mean token slots per expert, averaged over layers and the worst
layer; 1.0 is perfect) and the routing entropy (1.0 is uniform).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_families import val_loss  # noqa: E402  (the same held-out loss as the family comparison)
from provenance import machine_line, write_results  # noqa: E402
from kiln.tokens.loader import TokenLoader  # noqa: E402
from kiln.model.config import ModelConfig, padded_vocab  # noqa: E402
from kiln.model.families import build_model  # noqa: E402
from kiln.model.moe.balance import end_step, load_measures  # noqa: E402
from kiln.model.moe.counts import tensor_count  # noqa: E402
from kiln.model.moe.model import sparse_layers  # noqa: E402
from kiln.model.parallel import clip_grad_norm  # noqa: E402
from kiln.plan.memory import count_params  # noqa: E402
from kiln.tokens.shards import shard_paths  # noqa: E402
from kiln.train.optim import OptimConfig, make_optimizer, make_scheduler  # noqa: E402

BALANCES = {"aux_loss": {"router_aux_loss_coef": 0.01}, "aux_free": {"router_bias_rate": 0.001}, "none": {}}


def configs(a: argparse.Namespace, vocab: int) -> dict[str, ModelConfig]:
    shape = dict(vocab_size=vocab, block_size=a.seq_len, n_layer=a.n_layer, n_head=a.n_head, n_kv_head=a.n_kv_head,
                 n_embd=a.n_embd)
    out = {"dense": ModelConfig(family="llama", intermediate_size=a.ffn, qk_norm=True, **shape)}
    for name, extra in BALANCES.items():
        out[f"moe {name}"] = ModelConfig(family="moe", intermediate_size=a.ffn, n_experts=a.experts,
                                         n_experts_per_token=a.top_k, moe_intermediate_size=a.ffn // a.top_k,
                                         router_balance=name, **extra, **shape)
    return out


def train(name: str, cfg: ModelConfig, shards: Path, a: argparse.Namespace, seed: int) -> dict:
    torch.manual_seed(seed)
    model = build_model(cfg)
    opt_cfg = OptimConfig(lr=a.lr, warmup_steps=a.warmup)
    optimizer = make_optimizer(model, opt_cfg, torch.device("cpu"))
    scheduler = make_scheduler(optimizer, opt_cfg, a.steps)
    loader = TokenLoader(shard_paths(shards, "train"), a.batch, a.seq_len, seed=seed)
    val = shard_paths(shards, "val")
    train_s, late, experts = 0.0, None, sparse_layers(model)
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        x, y = loader.next_batch()  # (B, T) each
        model(x, y).backward()
        clip_grad_norm(model, opt_cfg.grad_clip)
        optimizer.step()
        moe = end_step(experts)  # the step's expert load; aux_free's biases moved
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        train_s += time.perf_counter() - t0
        if moe is not None and step > a.steps - 50:
            late = moe["load"] if late is None else late + moe["load"]
    tokens = a.steps * a.batch * a.seq_len
    counts = tensor_count(cfg) if cfg.family == "moe" else {"total": count_params(cfg)[0],
                                                            "active": count_params(cfg)[0]}
    out = {"name": name, "seed": seed, "params": counts["total"], "active_params": counts["active"], "train_s": train_s,
           "tokens_per_s": tokens / train_s, "final_val_loss": val_loss(model, val, a.batch, a.seq_len, a.eval_batches)}
    if late is not None:
        out.update({k.removeprefix("moe/"): v for k, v in load_measures(late).items()},
                   load_by_layer=late.long().tolist())
    print(f"  seed {seed} {name}: val {out['final_val_loss']:.4f}, {out['tokens_per_s']:,.0f} tok/s", flush=True)
    return out


def table(runs: list[dict]) -> list[str]:
    """One markdown row per model and seed."""
    out = ["| model | seed | parameters | active | tokens/s | validation loss | load max/mean (worst layer) | "
           "routing entropy |", "|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in runs:
        bal = (f"{r['load_max_over_mean']:.3f} ({r['load_max_over_mean_worst']:.3f}) | {r['load_entropy']:.3f}"
               if "load_entropy" in r else " | ")
        out.append(f"| {r['name']} | {r['seed']} | {r['params']:,} | {r['active_params']:,} | {r['tokens_per_s']:,.0f} "
                   f"| {r['final_val_loss']:.4f} | {bal} |")
    return out


def summary(runs: list[dict]) -> list[dict]:
    """Per model over the seeds: validation loss mean, min, max; for a mixture, its loss minus the dense model's of
    the same seed (mean, min, max; negative: the mixture is lower) and tokens/s relative to the dense model's."""
    dense = {r["seed"]: r for r in runs if r["name"] == "dense"}
    rows = []
    for name in dict.fromkeys(r["name"] for r in runs):
        mine = [r for r in runs if r["name"] == name]
        loss = [r["final_val_loss"] for r in mine]
        row = {"model": name, "seeds": len(mine), "loss_mean": sum(loss) / len(loss), "loss_min": min(loss),
               "loss_max": max(loss), "tokens_per_s_mean": sum(r["tokens_per_s"] for r in mine) / len(mine)}
        paired = [(r, dense[r["seed"]]) for r in mine if name != "dense" and r["seed"] in dense]
        if paired:
            diff = [r["final_val_loss"] - d["final_val_loss"] for r, d in paired]
            speed = [r["tokens_per_s"] / d["tokens_per_s"] for r, d in paired]
            row.update(diff_mean=sum(diff) / len(diff), diff_min=min(diff), diff_max=max(diff),
                       speed_vs_dense=sum(speed) / len(speed))
        rows.append(row)
    return rows


def summary_table(rows: list[dict]) -> list[str]:
    out = ["| model | seeds | validation loss mean (min .. max) | minus dense, same seed: mean (min .. max) | "
           "tokens/s (x dense) |", "|---|---:|---|---|---|"]
    for r in rows:
        diff = (f"{r['diff_mean']:+.4f} ({r['diff_min']:+.4f} .. {r['diff_max']:+.4f})" if "diff_mean" in r else "")
        speed = f"{r['tokens_per_s_mean']:,.0f}" + (f" ({r['speed_vs_dense']:.2f}x)" if "speed_vs_dense" in r else "")
        out.append(f"| {r['model']} | {r['seeds']} | {r['loss_mean']:.4f} ({r['loss_min']:.4f} .. {r['loss_max']:.4f}) "
                   f"| {diff} | {speed} |")
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", required=True, help="a token_shards folder (train_*.bin, val_*.bin, manifest.json)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds: initial weights and batch order")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-kv-head", type=int, default=2)
    p.add_argument("--ffn", type=int, default=384, help="the dense SwiGLU width; each expert is ffn / top-k wide")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=300, help="the token budget is steps x batch x seq_len")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--only", default="", help="comma-separated model names to run (dense, 'moe aux_loss', ...)")
    p.add_argument("--threads", type=int, default=1, help="1 on a shared machine: two threads on busy cores run slower")
    p.add_argument("--out", default="", help="write STEM.md and STEM.json (command, commit, date, machine inside)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    shards = Path(a.shards)
    manifest = json.loads((shards / "manifest.json").read_text())
    cfgs = configs(a, padded_vocab(manifest["vocab_size"]))
    wanted = {s.strip() for s in a.only.split(",") if s.strip()} or set(cfgs)
    tokens = a.steps * a.batch * a.seq_len
    print(f"{shards} ({manifest.get('encoding')}): {tokens:,} tokens each, {a.steps} steps of {a.batch} x {a.seq_len}, "
          f"{a.threads} threads; dense SwiGLU {a.ffn} vs {a.experts} experts of {a.ffn // a.top_k}, {a.top_k} per token",
          flush=True)
    seeds = [int(v) for v in a.seeds.split(",") if v.strip()]
    print(f"machine: {machine_line()}", flush=True)
    runs = [train(name, cfg, shards, a, seed) for seed in seeds for name, cfg in cfgs.items() if name in wanted]
    rows = summary(runs)
    lines = [*summary_table(rows), "", *table(runs)]
    print("\n".join(lines))
    result = {"shards": str(shards), "manifest_sha256": manifest.get("sha256"), "token_budget": tokens, "runs": runs,
              "summary": rows, "settings": {k: v for k, v in vars(a).items() if k not in ("out", "shards")}}
    if a.out:
        out = Path(a.out)
        about = (f"Token shards {shards} ({manifest.get('encoding')}, vocabulary {manifest['vocab_size']}): "
                 f"{tokens:,} training tokens per model, {a.steps} steps of {a.batch} x {a.seq_len}, {a.threads} "
                 f"thread(s); {a.n_layer} blocks of {a.n_embd}; dense SwiGLU {a.ffn} wide against {a.experts} experts "
                 f"of {a.ffn // a.top_k}, {a.top_k} per token (equal active parameters); seeds {a.seeds}. Validation "
                 f"loss: {a.eval_batches} held-out batches at the end. Load balance: the last 50 steps.")
        write_results(out, "Mixture of experts against dense, at equal active parameters and tokens", [about, "", *lines],
                      result, indent=2)
        print(f"wrote {out.with_suffix('.md')} and .json")
    return result


if __name__ == "__main__":
    main()
