"""Benchmark, side by side in one run: Muon's optimizer step under FSDP2 on two gloo ranks, each rank orthogonalising
only the matrices it owns (MuonAdamW) against every rank orthogonalising every matrix.

python bench/muon_step.py [--layers 6] [--width 512] [--kv-width 128] [--ffn 2048] [--steps 5] [--threads 1]
                          [--json out.json]

The matrices are a llama's block projections: per block q and o (width x width), k and v (kv-width x width), gate
and up (ffn x width), down (width x ffn), fully_shard-ed on dim 0 over a 2-rank CPU mesh, with fixed random
gradients. "every rank": each rank gathers each matrix's whole update, runs Newton-Schulz on it and keeps its own
rows (the compute DDP spends); "its share": MuonAdamW's step, each matrix orthogonalised on one rank. Both start from
the same weights and step alternately, one warm-up step then ``--steps`` timed steps each; a step's time is the
slower rank's. Reported: the median ms per step of each, their ratio, and whether both ended with the same weights
bit for bit.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln.train.optim import MUON_DEFAULTS, MuonAdamW, whole_muon_step  # noqa: E402


def shapes(layers: int, width: int, kv_width: int, ffn: int) -> list[tuple[int, int]]:
    """The (rows, cols) of every block matrix, block by block: q, k, v, o, gate, up, down."""
    block = [(width, width), (kv_width, width), (kv_width, width), (width, width), (ffn, width), (ffn, width),
             (width, ffn)]
    return block * layers


def sharded_matrices(mesh, sizes: list[tuple[int, int]]) -> torch.nn.Module:
    """A module of one parameter per shape (seeded), fully_shard-ed: each a DTensor sharded on dim 0."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.weights = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s) * 0.02) for s in sizes])
    fully_shard(module, mesh=mesh)
    return module


def step_on_every_rank(params: list[torch.Tensor], state: dict, group: dict) -> None:
    """One Muon step in which every rank gathers every matrix's whole update, orthogonalises it and keeps its rows."""
    for p in params:
        whole_muon_step(p, group, state)


def _worker(rank: int, port: int, a: argparse.Namespace, queue) -> None:
    """Rank ``rank`` of 2: both strategies, alternately; rank 0 puts the result."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        sizes = shapes(a.layers, a.width, a.kv_width, a.ffn)
        every, share = sharded_matrices(mesh, sizes), sharded_matrices(mesh, sizes)
        gen = torch.Generator().manual_seed(1)
        for p, q in zip(every.parameters(), share.parameters()):
            g = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = (distribute_tensor(g, mesh, [Shard(0)]) for _ in range(2))
        group = {**MUON_DEFAULTS, "lr": 0.02, "weight_decay": 0.1}
        every_state: dict = {}
        opt = MuonAdamW([{"params": list(share.parameters()), "kind": "muon"}], muon=group)
        steps = {"every": lambda: step_on_every_rank(list(every.parameters()), every_state, group),
                 "share": opt.step}
        times: dict[str, list[float]] = {k: [] for k in steps}
        for i in range(a.steps + 1):
            for name, step in steps.items():
                dist.barrier()
                t0 = time.perf_counter()
                with torch.no_grad():
                    step()
                slowest = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                if i:  # the first step is a warm-up
                    times[name].append(slowest.item())
        same = all(torch.equal(p.full_tensor(), q.full_tensor())
                   for p, q in zip(every.parameters(), share.parameters()))
        if rank == 0:
            queue.put({"matrices": len(sizes), "every_ms": 1e3 * statistics.median(times["every"]),
                       "share_ms": 1e3 * statistics.median(times["share"]), "same_weights": same,
                       "every_all_ms": [1e3 * t for t in times["every"]],
                       "share_all_ms": [1e3 * t for t in times["share"]]})
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--kv-width", type=int, default=128, help="rows of k_proj and v_proj (grouped-query attention)")
    p.add_argument("--ffn", type=int, default=2048, help="the SwiGLU width: rows of gate_proj and up_proj")
    p.add_argument("--steps", type=int, default=5, help="timed steps of each strategy, after one warm-up step")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(port, a, queue), nprocs=2, start_method="spawn")
    out = {**vars(a), **queue.get()}
    out["ratio_share_vs_every"] = out["share_ms"] / out["every_ms"]
    print(f"Muon step under FSDP2 on 2 gloo ranks, {a.threads} thread(s) each: {out['matrices']} matrices "
          f"({a.layers} llama blocks: width {a.width}, kv {a.kv_width}, ffn {a.ffn}), median of {a.steps} steps")
    print(f"  every rank orthogonalises every matrix: {out['every_ms']:8.1f} ms/step")
    print(f"  each rank its share (MuonAdamW):        {out['share_ms']:8.1f} ms/step = "
          f"{out['ratio_share_vs_every']:.2f}x the time ({1 / out['ratio_share_vs_every']:.2f}x faster)")
    print(f"  same weights bit for bit after {a.steps + 1} steps each: {'yes' if out['same_weights'] else 'NO'}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
