"""A small real Ray cluster on 127.0.0.1 for tests: a head node and worker nodes (one CPU and a small object
store each), started with ``ray start`` in a temp dir of its own and stopped by killing exactly the processes that
run from that temp dir (and their children), so other Ray clusters on the machine are left alone.

``python tests/ray_cluster.py`` starts one, prints its address, and stops it on Enter.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ports import free_port
from procs import children_of

ROOT = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).with_name("ray"))
OBJECT_STORE = 80 * 1024 * 1024  # bytes per node


def dashboard_installed() -> bool:
    """Whether Ray's dashboard can run here (``ray[default]``'s extras); without them the head runs none."""
    from importlib.util import find_spec

    return all(find_spec(m) is not None for m in ("aiohttp_cors", "prometheus_client", "opencensus"))


def pids_under(marker: str) -> list[int]:
    """Processes whose command line names ``marker`` (the cluster's temp dir), and all their descendants."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if marker.encode() in (d / "cmdline").read_bytes():
                    found.append(int(d.name))
            except OSError:
                continue
    kids, out = children_of(), []
    while found:
        p = found.pop()
        if p not in out:
            out.append(p)
            found.extend(kids.get(p, []))
    return out


class RayCluster:
    """``start()`` a head and ``workers`` worker nodes; ``address``; ``kill_node(i)``; ``stop()``."""

    def __init__(self, workers: int = 1, object_store: int = OBJECT_STORE, dashboard: bool = True) -> None:
        self.temp = tempfile.mkdtemp(prefix="kray-", dir="/tmp")  # short: Ray's socket paths must fit 107 chars
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.workers, self.object_store, self.dashboard = workers, object_store, dashboard
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}

    def _ray_start(self, *args: str) -> None:
        cmd = [RAY, "start", "--node-ip-address=127.0.0.1", "--num-cpus=1", f"--object-store-memory={self.object_store}",
               f"--temp-dir={self.temp}", f"--dashboard-agent-listen-port={free_port()}", "--disable-usage-stats",
               *args]
        subprocess.run(cmd, env=self.env, check=True, capture_output=True, text=True, timeout=120)

    def start(self) -> "RayCluster":
        self.dashboard_port = free_port() if self.dashboard and dashboard_installed() else 0
        self._ray_start("--head", f"--port={self.port}", f"--include-dashboard={bool(self.dashboard_port)}".lower(),
                        "--dashboard-host=127.0.0.1", f"--ray-client-server-port={free_port()}",
                        f"--dashboard-port={self.dashboard_port or free_port()}")
        for _ in range(self.workers):
            self.add_worker()
        return self

    def add_worker(self) -> None:
        self._ray_start(f"--address={self.address}")

    def raylets(self) -> list[int]:
        """The raylet pids, head first."""
        out = []
        for p in pids_under(self.temp):
            try:
                if Path(f"/proc/{p}/exe").resolve().name == "raylet":
                    out.append(p)
            except OSError:
                continue
        return sorted(out)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL, every process of this cluster (found by its temp dir), by pid; then the temp dir."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = pids_under(self.temp)
            for p in pids:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + 5
            while pids and time.time() < deadline and pids_under(self.temp):
                time.sleep(0.2)
        shutil.rmtree(self.temp, ignore_errors=True)


if __name__ == "__main__":
    c = RayCluster().start()
    print(c.address, c.temp)
    try:
        input("Enter stops it ")
    finally:
        c.stop()
