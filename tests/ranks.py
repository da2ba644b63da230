"""Test helper: run a function on n spawned processes and collect what each rank puts on a queue."""

from __future__ import annotations

import time
from typing import Any, Callable

from ports import free_port


def on_ranks(worker: Callable[..., None], n: int, *args: Any, timeout_s: float = 600) -> dict[int, Any]:
    """{rank: what ``worker(rank, port, queue, *args)`` put on the queue as ``(rank, value)``} from ``n`` spawned
    processes, ``port`` a free one for their process group. The queue is read while the processes run, so a result
    larger than a pipe's buffer cannot block its sender; a worker that fails raises its error here (the others are
    stopped), and ranks still running after ``timeout_s`` (a hung collective) are stopped with a TimeoutError."""
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    procs = mp.start_processes(worker, args=(free_port(), queue, *args), nprocs=n, start_method="spawn", join=False)
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        while not queue.empty():
            rank, value = queue.get()
            got[rank] = value
        if procs.join(timeout=0.2):  # every process exited cleanly (a failed one raises ProcessRaisedException)
            while not queue.empty():
                rank, value = queue.get()
                got[rank] = value
            break
        if time.monotonic() > deadline:
            for p in procs.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{worker.__name__} on {n} ranks: ranks {sorted(set(range(n)) - set(got))} had not "
                               f"answered after {timeout_s:.0f} s (a hung collective?)")
    missing = sorted(set(range(n)) - set(got))
    if missing:
        raise RuntimeError(f"{worker.__name__}: ranks {missing} exited without a result")
    return got
