"""Tests for kiln.common.files: staging folders left by killed processes are removed when the next one stages beside
them (and nothing else is).

Run: python -m pytest tests/kiln/common/test_files.py -q
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kiln.common.files import staging_dir

ROOT = Path(__file__).resolve().parents[3]
HOLD = """
import sys, time
from kiln.common.files import staging_dir
with staging_dir(sys.argv[1]) as stage:
    (stage / "half.bin").write_bytes(b"half a file")
    print(stage, flush=True)
    time.sleep(120)
"""


def holding_a_stage(parent: Path) -> tuple[subprocess.Popen, Path]:
    """A process inside staging_dir(parent), and its staging folder."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(parent)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc, Path(proc.stdout.readline().strip())  # type: ignore[union-attr]


def test_staging_left_by_killed_processes_is_removed_and_nothing_else(tmp_path) -> None:
    parent = tmp_path / "clean_corpus"
    parent.mkdir()
    live, held = holding_a_stage(parent)  # a run staging right now
    try:
        killed, left = holding_a_stage(parent)
        killed.send_signal(signal.SIGKILL)  # killed part way: its staging folder stays behind
        killed.wait(timeout=30)
        old = time.time() - 3600  # before this process started
        for name in (".stage.abcd1234", ".stage.zz_9x7y6", ".notes.abcd1234", ".stage-keep", ".git", "stage.abcd1234",
                     ".stage.0badc0de-1-1.abcd1234"):  # the last: owned by a process of another host
            (parent / name).mkdir()
            (parent / name / "f").write_text("x")
            os.utime(parent / name, (old, old))
        (parent / ".stage.qwertyui").mkdir()  # a stage of an older version that started after this process did
        (parent / "v1").mkdir()
        assert left.is_dir() and left.name.startswith(".stage.")
        with staging_dir(parent) as stage:
            kept = sorted(p.name for p in parent.iterdir())
        assert not left.exists() and held.is_dir()
        assert kept == sorted([held.name, stage.name, ".notes.abcd1234", ".stage-keep", ".git", "stage.abcd1234",
                               ".stage.0badc0de-1-1.abcd1234", ".stage.qwertyui", "v1"])
    finally:
        live.kill()
        live.wait(timeout=30)


def test_a_live_processs_own_stages_are_kept(tmp_path) -> None:
    with staging_dir(tmp_path) as outer:
        with staging_dir(tmp_path) as inner:
            assert outer.is_dir() and inner.is_dir() and outer != inner
        (tmp_path / "v1").mkdir()
    assert [p.name for p in tmp_path.iterdir()] == ["v1"]

