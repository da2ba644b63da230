"""Test helper: run a function on n spawned processes and collect what each rank puts on a queue."""

from __future__ import annotations

from typing import Any, Callable

from ports import free_port


def on_ranks(worker: Callable[..., None], n: int, *args: Any) -> dict[int, Any]:
    """{rank: what ``worker(rank, port, queue, *args)`` put on the queue as ``(rank, value)``} from ``n`` spawned
    processes, ``port`` a free one for their process group. The queue is read before the processes are joined, so a
    result larger than a pipe's buffer cannot block its sender."""
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    procs = mp.start_processes(worker, args=(free_port(), queue, *args), nprocs=n, start_method="spawn", join=False)
    got = dict(queue.get() for _ in range(n))
    while not procs.join():
        pass
    return got
