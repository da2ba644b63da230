"""Benchmark, side by side in one run: training steps of one model on one device, then split over ``--ranks``
devices, same seed, same batches: tensor-parallel (``--split tp``: with sequence parallelism,
kiln.model.tensor_parallel) or pipeline stages (``--split pp``: kiln.model.pipeline_parallel, ``--schedule``).

python bench/model_parallel.py [--split tp|pp] [--device cpu|cuda] [--family llama|gpt2] [--layers 4] [--width 256]
                               [--heads 8] [--vocab 4096] [--seq-len 256] [--micro-batch 8] [--steps 10] [--ranks 2]
                               [--schedule 1f1b] [--microbatches 4] [--json out.json]

Both runs take a fwd + bwd + AdamW step on the same (micro-batch, seq-len) batch; the first alone on rank 0's device
(on CPU with every thread the ranks share between them; under ``--split pp`` accumulating the same micro-batches the
pipeline runs), the second split ``--ranks`` ways (gloo on CPU, NCCL on CUDA). Reported: the median tokens/s of each
after one warm-up step, their ratio, the peak memory per rank on CUDA, and the largest difference of their losses
over the steps. On CPU the ratio mostly shows communication overhead (two ranks share two cores); on GPUs it shows
what splitting the model costs or gains at this size.
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


def timed_steps(model, data, device, accumulate: int = 1, params=None) -> tuple[list[float], list[float]]:
    """(seconds per step after the first, loss per step). ``model`` is a module, called on ``accumulate`` slices of
    each batch in turn (gradient accumulation), or a kiln.model.pipeline_parallel.Pipeline (``params`` its
    parameters), stepped on the whole batch."""
    from kiln.model.parallel import full_value

    opt = torch.optim.AdamW(params if params is not None else model.parameters(), lr=1e-3)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, losses = [], []
    for i, (x, y) in enumerate(data):
        sync()
        t0 = time.perf_counter()
        if params is not None:
            loss = model.step(x, y)
        else:
            loss = torch.zeros((), device=device)
            for xs, ys in zip(x.tensor_split(accumulate), y.tensor_split(accumulate)):
                part = model(xs, ys) / accumulate
                part.backward()
                loss = loss + full_value(part.detach())
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
        pp = a.split == "pp"
        if rank == 0:  # one device alone, with the threads every rank has together
            torch.set_num_threads(a.threads * a.ranks)
            one = copy.deepcopy(model).to(device)
            times, losses = timed_steps(one, batches(a, device), device, a.microbatches if pp else 1)
            result["one"] = {"s": times, "loss": losses,
                             "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}
            del one
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
        dist.barrier()
        torch.set_num_threads(a.threads)
        if pp:
            from kiln.model.pipeline_parallel import Pipeline, PipelineConfig

            looped = a.schedule.startswith("interleaved")
            pipe = Pipeline(model, PipelineConfig(a.schedule, 2 if looped else 1, a.microbatches), dist.group.WORLD,
                            device, batch=a.micro_batch)
            times, losses = timed_steps(pipe, batches(a, device), device, params=list(pipe.parameters()))
        else:
            mesh = build_mesh(MeshLayout(dp_shard=1, tp=a.ranks), device.type)["tp"]
            tp = apply_tp(model.to(device), mesh)
            times, losses = timed_steps(tp, batches(a, device), device)
        result["split"] = {"s": times, "loss": losses,
                        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}
        queue.put((rank, result))
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--split", default="tp", choices=["tp", "pp"], help="tensor parallelism or pipeline stages")
    p.add_argument("--schedule", default="1f1b", help="--split pp: gpipe, 1f1b, interleaved_1f1b (2 stages per rank)")
    p.add_argument("--microbatches", type=int, default=4, help="--split pp: micro-batches the batch is cut into")
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
    one, split = got[0]["one"], got[0]["split"]
    name = f"TP{a.ranks}" if a.split == "tp" else f"PP{a.ranks} {a.schedule} m {a.microbatches}"
    row = {"split": a.split, "family": a.family, "device": a.device, "ranks": a.ranks, "tokens_per_step": tokens,
           **({"schedule": a.schedule, "microbatches": a.microbatches} if a.split == "pp" else {}),
           "one_tokens_per_s": tokens / statistics.median(one["s"]),
           "split_tokens_per_s": tokens / statistics.median(max(got[r]["split"]["s"][i] for r in got)
                                                            for i in range(a.steps)),
           "max_loss_diff": max(abs(x - y) for x, y in zip(one["loss"], split["loss"])),
           "one_peak_gib": one["peak_gib"],
           "split_peak_gib_per_rank": max(got[r]["split"]["peak_gib"] for r in got) if one["peak_gib"] else None}
    row["split_over_one"] = row["split_tokens_per_s"] / row["one_tokens_per_s"]
    print(f"{a.family} {a.layers}x{a.width}, vocab {a.vocab}, {a.micro_batch}x{a.seq_len} tokens/step on {a.device}: "
          f"one device {row['one_tokens_per_s']:,.0f} tok/s, {name} {row['split_tokens_per_s']:,.0f} tok/s "
          f"(x{row['split_over_one']:.2f}); max |loss difference| {row['max_loss_diff']:.2e}"
          + (f"; peak memory {one['peak_gib']:.2f} GiB vs {row['split_peak_gib_per_rank']:.2f} GiB per rank"
             if one["peak_gib"] else ""))
    if a.json:
        a.json.write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
