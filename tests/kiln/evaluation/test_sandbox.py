"""Tests for kiln.evaluation.sandbox: programs pass and fail as they should, and every escape is stopped, counted by
kind and leaves the host as it was, with the guard on (both layers) and off (what the kernel stops by itself).

Run: python -m pytest tests/kiln/evaluation/test_sandbox.py -q   (about 10 s on 2 cores: two 2-second timeouts, CPU loops)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from kiln.evaluation.sandbox import Limits, isolation, own_uids, run, run_many

LIMITS = Limits(timeout_s=2.0, cpu_s=1, memory_mb=256, file_size_mb=8, processes=8)
KERNEL = isolation().mode != "none"  # namespaces hold: the kernel alone stops writes and sockets
GUARDS = [True, False] if KERNEL else [True]


def sandbox_processes() -> list[int]:
    """Pids of processes (zombies included) running as a uid this process gave its sandboxes (as root each sandbox
    runs as its own; other test workers' sandboxes use others)."""
    out, mine = [], own_uids()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            uid = int(Path(f"/proc/{pid}/status").read_text().split("\nUid:")[1].split()[0])
        except (OSError, IndexError, ValueError):
            continue
        if uid in mine:
            out.append(int(pid))
    return out


def test_isolation_here_is_the_strongest_this_machine_allows():
    iso = isolation()
    if os.geteuid() == 0:
        assert iso.mode == "root" and iso.tried == ()
    assert iso.network == ("namespace" if iso.mode != "none" else "guard")
    assert run("pass").isolation == iso.mode


def test_programs_pass_fail_and_their_output_is_kept_truncated():
    ok = run("import math\nprint(math.factorial(5))")
    assert (ok.outcome, ok.kind, ok.stdout, ok.passed) == ("passed", "passed", "120\n", True)
    bad = run("def f():\n    return 1\nassert f() == 2, 'f is wrong'")
    assert (bad.outcome, bad.detail) == ("failed", "AssertionError: f is wrong")
    assert "line 3" in bad.stderr and bad.stderr.rstrip().endswith("AssertionError: f is wrong")
    assert run("def f(:\n    pass").detail.startswith("SyntaxError: ")
    # leaving early is no pass: sys.exit(0) and os._exit(0) before the end both fail
    assert run("import sys\nsys.exit(0)\nassert False").detail == \
        "the program exited (SystemExit 0) before its tests finished"
    assert run("import os\nos._exit(0)").detail == "exited with code 0 before its tests finished"
    long = run("print('x' * 100_000)\nimport sys\nprint('y' * 100_000, file=sys.stderr)", Limits(output_chars=500))
    assert long.passed and long.stdout == "x" * 500 + "…" and long.stderr == "…" + "y" * 499 + "\n"


def test_each_program_gets_a_fresh_folder_a_clean_environment_and_no_stdin(monkeypatch):
    monkeypatch.setenv("KILN_SANDBOX_SECRET", "do-not-leak")
    code = ("import os, sys\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))\nopen('mine.txt', 'w').write('x')\n"
            "print(sorted(os.environ))\nprint(repr(sys.stdin.read()))")
    first, second = run(code), run(code)
    folder, files, env, stdin = first.stdout.splitlines()
    assert files == "['program.py']" and second.stdout.splitlines()[1] == "['program.py']"  # mine.txt did not stay
    assert not Path(folder).exists() and folder != second.stdout.splitlines()[0]
    assert "KILN_SANDBOX_SECRET" not in env and eval(env) == ["HOME", "LANG", "LC_ALL", "OMP_NUM_THREADS", "PATH",
                                                               "TMPDIR"]
    assert stdin == "''"


@pytest.mark.parametrize("guard", GUARDS, ids=lambda g: "guard" if g else "kernel-only")
def test_writes_outside_the_folder_fail_and_leave_no_file(tmp_path, guard):
    targets = [tmp_path / "escaped.txt", Path(f"/tmp/kiln-escape-{uuid.uuid4().hex}.txt")]  # private and world-writable
    for target in targets:
        res = run(f"open({str(target)!r}, 'w').write('escaped')", LIMITS, guard=guard)
        assert res.kind == "blocked:filesystem" and res.by == ("guard" if guard else "kernel")
        assert not target.exists()
    res = run("import os\nos.symlink('/tmp', 'out')\nopen('out/kiln-escape-link.txt', 'w')", LIMITS, guard=guard)
    assert res.kind == "blocked:filesystem" and not Path("/tmp/kiln-escape-link.txt").exists()
    if guard:
        assert res.refused and "outside the folder" in res.refused[0]


@pytest.mark.parametrize("guard", GUARDS, ids=lambda g: "guard" if g else "kernel-only")
def test_a_fork_bomb_is_stopped_and_the_host_can_still_start_processes(guard):
    t0 = time.perf_counter()
    res = run("import os\nwhile True:\n    os.fork()", LIMITS, guard=guard)
    assert time.perf_counter() - t0 < LIMITS.timeout_s + 3
    assert res.kind == ("blocked:process" if guard else "killed:processes"), res
    assert subprocess.run([sys.executable, "-c", "print(7 * 6)"], capture_output=True, text=True).stdout == "42\n"
    assert sandbox_processes() == []  # nothing it forked outlives it
    # threads count as processes; each also takes an 8 MiB stack and a 64 MiB malloc arena of address space
    spawn = "import threading, time\nfor _ in range(50):\n    threading.Thread(target=time.sleep, args=(9,)).start()"
    assert run(spawn, replace(LIMITS, memory_mb=2048), guard=guard).kind == "killed:processes"
    assert run(spawn, LIMITS, guard=guard).kind == "killed:memory"  # 256 MiB: a few threads, then no room


@pytest.mark.parametrize("guard", GUARDS, ids=lambda g: "guard" if g else "kernel-only")
def test_no_connection_reaches_a_port_the_host_listens_on(guard):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        res = run(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'hi')",
                  LIMITS, guard=guard)
        with pytest.raises(socket.timeout):
            server.accept()
    assert res.kind == "blocked:network" and res.by == ("guard" if guard else "kernel")


def test_a_program_that_sleeps_forever_is_killed_at_the_timeout():
    t0 = time.perf_counter()
    res = run("import time\ntime.sleep(10 ** 6)", LIMITS)
    assert res.kind == "timeout" and res.by == "timer" and LIMITS.timeout_s <= time.perf_counter() - t0 < LIMITS.timeout_s + 2
    assert sandbox_processes() == []  # killed and reaped before run() returned: not even a zombie is left
    assert bool(own_uids()) == (isolation().mode == "root")  # the check above looked at the uid it ran as


@pytest.mark.parametrize("guard", GUARDS, ids=lambda g: "guard" if g else "kernel-only")
def test_memory_file_size_and_cpu_limits_kill_quickly(guard):
    t0 = time.perf_counter()
    memory = run("block = bytearray(10 * 2 ** 30)", LIMITS, guard=guard)  # 10 GB against 256 MB
    assert memory.kind == "killed:memory" and time.perf_counter() - t0 < 2
    t0 = time.perf_counter()
    big = run("with open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(bytes(2 ** 20))", LIMITS, guard=guard)
    assert big.kind == "killed:file_size" and big.detail == "OSError: [Errno 27] File too large"
    assert time.perf_counter() - t0 < 5
    cpu = run("while True:\n    pass", LIMITS, guard=guard)
    assert cpu.kind == "killed:cpu" and cpu.cpu_s >= 0.5 * LIMITS.cpu_s and cpu.seconds < LIMITS.timeout_s


def test_run_many_keeps_order_and_counts_each_kind():
    programs = ["pass", "assert False", "import time\ntime.sleep(60)", "x = bytearray(2 ** 34)", "import socket"]
    kinds = [r.kind for r in run_many(programs, LIMITS, workers=2)]
    assert kinds == ["passed", "failed", "timeout", "killed:memory", "blocked:network"]


def test_limits_name_the_field_at_fault():
    with pytest.raises(ValueError, match=r"Limits\.cpu_s must be a positive whole number, got 0"):
        Limits(cpu_s=0)
    with pytest.raises(ValueError, match=r"Limits\.memory_mb must be a positive whole number, got 1.5"):
        Limits(memory_mb=1.5)
    with pytest.raises(ValueError, match="sandbox mode must be one of"):
        run("pass", mode="chroot")
