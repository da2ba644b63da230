"""Test helper: a real ``mlflow server`` on 127.0.0.1 with its own sqlite store and proxied artifact store
(`from mlflow_server import running_server`)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from ports import free_port


@contextlib.contextmanager
def running_server(root: Path) -> Iterator[str]:
    """The server's URL while it runs, its store and artifacts under ``root``; stopped (its process group killed)
    on exit. A server that does not answer /health within two minutes is a RuntimeError quoting its log."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
           "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
        log.close()
