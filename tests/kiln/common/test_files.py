"""Tests for kiln.common.files: staging folders left by killed processes are removed when the next one stages beside
them (and nothing else is), witnesses that check a file or folder cheaply, and commit_dir filling a file set aside.

Run: python -m pytest tests/kiln/common/test_files.py -q
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kiln.common.files import check_witness, commit_dir, set_aside, staging_dir, witness

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


def test_witness_trusts_an_unchanged_stat_and_hashes_a_changed_one(tmp_path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.bin").write_bytes(b"a" * 100)
    (tmp_path / "d" / "sub" / "b.bin").write_bytes(b"b" * 10)
    (tmp_path / "d" / ".verified.json").write_text("{}")  # hidden: bookkeeping, not content
    w = witness(tmp_path / "d")
    assert sorted(w["files"]) == ["a.bin", "sub/b.bin"] and w["algo"] == "xxh3_128"
    assert check_witness(tmp_path / "d", w) is None
    a = tmp_path / "d" / "a.bin"
    st = a.stat()
    a.write_bytes(b"c" * 100)
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and time: not read, so not noticed
    assert check_witness(tmp_path / "d", w) is None
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    bad, why = check_witness(tmp_path / "d", w)
    assert bad == a and "checksum mismatch" in why and str(a) in why
    a.write_bytes(b"a" * 100)  # the same bytes again, a new time: hashed and accepted
    assert check_witness(tmp_path / "d", w) is None
    a.write_bytes(b"a" * 99)
    assert check_witness(tmp_path / "d", w) == (a, f"{a} has 99 bytes where 100 were recorded: it is truncated or "
                                                    "was replaced")
    (tmp_path / "d" / "sub" / "b.bin").unlink()
    a.write_bytes(b"a" * 100)
    assert check_witness(tmp_path / "d", w)[1] == f"{tmp_path / 'd' / 'sub' / 'b.bin'} is missing"
    single = witness(a)
    assert list(single["files"]) == ["."] and check_witness(a, single) is None


def test_commit_dir_keeps_an_existing_folder_and_fills_in_what_was_set_aside(tmp_path) -> None:
    final = tmp_path / "v1"
    final.mkdir()
    (final / "data.bin").write_bytes(b"damaged!")
    (final / "report.json").write_text('{"took_s": 1}')
    aside = set_aside(final / "data.bin")
    assert aside == final / ".data.bin.damaged" and aside.read_bytes() == b"damaged!"
    stage = tmp_path / ".stage"
    stage.mkdir()
    (stage / "data.bin").write_bytes(b"original")
    (stage / "report.json").write_text('{"took_s": 2}')
    assert commit_dir(stage, final) == final and not stage.exists()
    assert (final / "data.bin").read_bytes() == b"original"
    assert (final / "report.json").read_text() == '{"took_s": 1}'  # what was there is kept as it is
