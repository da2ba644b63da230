"""Benchmark, side by side in one run: training steps of one model on one device, then tensor-parallel (with sequence
parallelism, kiln.model.tensor_parallel) over ``--ranks`` devices, same seed, same batches.

python bench/tensor_parallel.py [--device cpu|cuda] [--family llama|gpt2] [--layers 4] [--width 256] [--heads 8]
                                [--vocab 4096] [--seq-len 256] [--micro-batch 8] [--steps 10] [--ranks 2] [--json out.json]

Both runs take a fwd + bwd + AdamW step on the same (micro-batch, seq-len) batch; the first alone on rank 0's device
(on CPU with every thread the ranks share between them), the second split ``--ranks`` ways (gloo on CPU, NCCL on
CUDA). Reported: the median tokens/s of each after one warm-up step, their ratio, the peak memory per rank on CUDA,
and the largest difference of their losses over the steps. On CPU the ratio mostly shows communication overhead (two
ranks share two cores); on GPUs it shows what splitting each layer costs or gains at this size.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(a: argparse.Namespace):
    from kiln.model.config import ModelConfig
    from kiln.model.families import build_model

    extra = {"family": "llama", "n_kv_head": max(1, a.heads // 2), "tie_embeddings": False} if a.family == "llama" else {}
    torch.manual_seed(0)
    return build_model(ModelConfig(vocab_size=a.vocab, block_size=a.seq_len, n_layer=a.layers, n_head=a.heads,
                                   n_embd=a.width, dropout=0.0, **extra))


def batches(a: argparse.Namespace, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(a.steps + 1):
        x = torch.randint(0, a.vocab, (a.micro_batch, a.seq_len), generator=gen)
        out.append((x.to(device), ((7 * x + 3) % a.vocab).to(device)))
    return out


def timed_steps(model, data, device) -> tuple[list[float], list[float]]:
    """(seconds per step after the first, loss per step)."""
    from kiln.model.parallel import full_value

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, losses = [], []
    for i, (x, y) in enumerate(data):
        sync()
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(full_value(loss.detach())))
        sync()
        if i:
            times.append(time.perf_counter() - t0)
    return times, losses


def _worker(rank: int, port: int, a: argparse.Namespace, queue) -> None:
    import torch.distributed as dist

    from kiln.model.parallel import MeshLayout, build_mesh
    from kiln.model.tensor_parallel import apply_tp

    cuda = a.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=a.ranks)
    try:
        model = build(a)
        result = {}
        if rank == 0:  # one device alone, with the threads every rank has together
            torch.set_num_threads(a.threads * a.ranks)
            one = copy.deepcopy(model).to(device)
            times, losses = timed_steps(one, batches(a, device), device)
            result["one"] = {"s": times, "loss": losses,
                             "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}
            del one
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
        dist.barrier()
        torch.set_num_threads(a.threads)
        mesh = build_mesh(MeshLayout(dp_shard=1, tp=a.ranks), device.type)["tp"]
        tp = apply_tp(model.to(device), mesh)
        times, losses = timed_steps(tp, batches(a, device), device)
        result["tp"] = {"s": times, "loss": losses,
                        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}
        queue.put((rank, result))
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--family", default="llama", choices=["llama", "gpt2"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="CPU threads per rank")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from ports import free_port

    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(free_port(), a, queue), nprocs=a.ranks, start_method="spawn")
    got = dict(queue.get() for _ in range(a.ranks))
    tokens = a.micro_batch * a.seq_len
    one, tp = got[0]["one"], got[0]["tp"]
    row = {"family": a.family, "device": a.device, "ranks": a.ranks, "tokens_per_step": tokens,
           "one_tokens_per_s": tokens / statistics.median(one["s"]),
           "tp_tokens_per_s": tokens / statistics.median(max(got[r]["tp"]["s"][i] for r in got)
                                                         for i in range(a.steps)),
           "max_loss_diff": max(abs(x - y) for x, y in zip(one["loss"], tp["loss"])),
           "one_peak_gib": one["peak_gib"], "tp_peak_gib_per_rank": tp["peak_gib"]}
    row["tp_over_one"] = row["tp_tokens_per_s"] / row["one_tokens_per_s"]
    print(f"{a.family} {a.layers}x{a.width}, vocab {a.vocab}, {a.micro_batch}x{a.seq_len} tokens/step on {a.device}: "
          f"one device {row['one_tokens_per_s']:,.0f} tok/s, TP{a.ranks} {row['tp_tokens_per_s']:,.0f} tok/s "
          f"(x{row['tp_over_one']:.2f}); max |loss difference| {row['max_loss_diff']:.2e}"
          + (f"; peak memory {one['peak_gib']:.2f} GiB vs {tp['peak_gib']:.2f} GiB per rank" if one["peak_gib"] else ""))
    if a.json:
        a.json.write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
