"""``make ui``'s script (scripts/ui.sh) starts both UIs and stops every process it started on Ctrl-C (SIGINT), with
MLflow's background job workers off.

Run: python -m pytest tests/ui/test_ui_script.py -q   (slow: dagster dev and mlflow ui start in about a minute)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from ports import free_port
from procs import children_of

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the started processes through /proc")]


def _default_sigint() -> None:
    """Ctrl-C's default action in the script, as in a terminal: a test run started in the background of a
    non-interactive shell ignores SIGINT, the script would inherit that, and bash cannot trap a signal ignored on entry."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def descendants(pid: int) -> set[int]:
    tree, found, todo = children_of(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


# make's part in ``make ui``: a parent that does not pass a signal on to the script (it just ends)
MAKE_LIKE = ("import os, signal, subprocess, sys; p = subprocess.Popen(sys.argv[1:]); "
             "signal.signal(signal.SIGINT, lambda *a: os._exit(130)); p.wait()")


@pytest.mark.parametrize("to", ["script", "parent"])
def test_ui_script_stops_every_child_on_ctrl_c(tmp_path, to):
    """SIGINT to the script (Ctrl-C in its terminal), or to its parent alone (`kill -INT` of make ui's pid: make ends
    without passing it on): every process the script started stops."""
    home = tmp_path / "kiln"
    (home / "dagster").mkdir(parents=True)
    (home / "dagster" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    dagster_port, mlflow_port = free_port(), free_port()
    env = {**os.environ, "DAGSTER_HOME": str(home / "dagster"), "DAGSTER_PORT": str(dagster_port),
           "MLFLOW_PORT": str(mlflow_port), "PYTHONPATH": str(ROOT)}
    env.pop("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", None)
    log = open(tmp_path / "ui.log", "wb")
    script = ["bash", "scripts/ui.sh", str(Path(sys.executable).parent), str(home)]
    proc = subprocess.Popen(script if to == "script" else [sys.executable, "-c", MAKE_LIKE, *script], cwd=ROOT,
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_default_sigint)
    started: set[int] = set()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (answers(f"http://127.0.0.1:{dagster_port}/server_info") and answers(f"http://127.0.0.1:{mlflow_port}/health")):
            assert proc.poll() is None, (tmp_path / "ui.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"the UIs did not answer in {START_TIMEOUT_S}s"
            time.sleep(1)
        started = descendants(proc.pid)
        lines = {p: cmdline(p) for p in started}
        assert any("dagster" in c for c in lines.values()) and any("mlflow" in c for c in lines.values()), lines
        assert not any("huey" in c for c in lines.values()), lines  # MLflow's job workers are off by default
        os.kill(proc.pid, signal.SIGINT)  # what Ctrl-C sends the script, or kill -INT sends make
        assert proc.wait(timeout=60) == 130
        deadline = time.monotonic() + 30
        while (left := [p for p in started if Path(f"/proc/{p}").exists() and cmdline(p)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert left == [], {p: cmdline(p) for p in left}
        assert not answers(f"http://127.0.0.1:{dagster_port}/server_info")
        assert not answers(f"http://127.0.0.1:{mlflow_port}/health")
    finally:
        for p in started | ({proc.pid} if proc.poll() is None else set()):
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        log.close()
