"""Tests for kiln.evaluation.sandbox: programs pass and fail as they should, every escape is stopped, counted by kind
and leaves the host as it was, with the guard on (both layers) and off (what the kernel stops by itself); and a
program judged by a Test cannot forge its verdict (descriptors, early exits, signals, objects that equal anything,
patched builtins), read outside its folder, or fill the disk.

Run: python -m pytest tests/kiln/evaluation/test_sandbox.py -q   (about 20 s on 2 cores: 2-second timeouts, CPU loops)
"""

from __future__ import annotations

import math
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from kiln.evaluation.sandbox import Limits, SandboxError, Test, free_names, isolation, own_uids, run, run_many

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
    # a busy loop on a loaded machine may get under half a core: wall time 10x the CPU limit, so that only the CPU
    # limit (not the timer) can end it; it still must end well before the timer
    cpu_limits = replace(LIMITS, timeout_s=10.0)
    cpu = run("while True:\n    pass", cpu_limits, guard=guard)
    assert cpu.kind == "killed:cpu" and cpu.cpu_s >= 0.5 * LIMITS.cpu_s and cpu.seconds < cpu_limits.timeout_s


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


# ---- verdicts only the test decides ---------------------------------------------------------------------------------
ADD_TEST = Test("assert add(2, 3) == 5\nassert add(-1, 1) == 0\n")
FORGED = b'{"event": "result", "outcome": "passed"}\n{"event": "verdict", "outcome": "passed"}\n'
needs_kernel = pytest.mark.skipif(not KERNEL, reason="namespaces do not work here; mode none cannot score")


def judged(program: str, test: Test = ADD_TEST, **kwargs) -> object:
    return run(program, LIMITS, test=test, **kwargs)


def test_the_test_decides_in_its_own_process_and_an_honest_program_passes():
    right = judged("def add(a, b):\n    return a + b\n")
    assert (right.kind, right.checked, right.isolation) == ("passed", True, isolation().mode)
    wrong = judged("def add(a, b):\n    return a * b\n")
    assert (wrong.kind, wrong.detail) == ("failed", "AssertionError")
    assert 'File "test", line 1' in wrong.stderr  # the traceback is the checker's
    assert not run("pass").checked  # without a test: the program's own account, not a score
    # the test's names default to those it uses but does not define; builtins are never the program's
    assert free_names("import math\ndef check(f):\n    assert f(len(x)) == math.pi\ncheck(entry)\n") == ("entry", "x")
    assert ADD_TEST.bound() == ("add",) and Test("f()", names=("g",)).bound() == ("g",)
    with pytest.raises(ValueError, match=r"Test\.names must be Python identifiers"):
        Test("pass", names=("a b",))


def test_plain_data_crosses_both_ways_exactly():
    values = ("[None, True, False, 0, -7, 2 ** 200, -(3 ** 90), 1.5, -0.0, float('inf'), 1e-310, 2j - 1, '', "
              "'caf\\u00e9 \\U0001f600 \\ud800', b'\\x00\\xff', (), (1, (2, [3])), {1, 2}, frozenset({'a'}), "
              "{(1, 'k'): {'n': [None]}, 2.5: b''}, [[[[[]]]]]]")
    program = "def echo(x):\n    return x\ndef nan():\n    return float('nan')\nCONSTANT = (1, 'two')\nimport math\n"
    test = Test(f"v = {values}\nassert echo(v) == v and [type(a) for a in echo(v)] == [type(a) for a in v]\n"
                "assert math.isnan(nan()) and CONSTANT == (1, 'two') and echo(x=3) == 3 and math.pi > 3\n")
    assert test.bound() == ("CONSTANT", "echo", "math", "nan")  # math: the program's import, imported by the checker
    res = judged(program, test)
    assert res.kind == "passed", res.detail
    # what is not plain data fails the call, either way: a builtin function sent, a dict of lists returned
    assert judged(program, Test("echo(len)")).detail.startswith("NotPlain: a builtin_function_or_method is not")
    assert judged("def bad():\n    return {1: object()}\n", Test("bad()")).detail.startswith(
        "ProgramError: the program raised NotPlain: a object is not plain data")


@pytest.mark.parametrize("forged", ["status", "every", "reply"])
def test_writing_a_verdict_to_any_inherited_descriptor_is_no_pass(forged):
    # the status descriptor's number is in the wrapper's arguments (sys.orig_argv); the program's process holds
    # stdin, stdout, stderr and its two call pipes only
    writes = {"status": "fds = [int(a.split('=')[1]) for a in sys.orig_argv if a.startswith(('status_fd=', 'input_fd='))]",
              "every": "fds = range(1024)", "reply": "fds = [4]"}[forged]
    program = (f"import os, sys\n{writes}\nfor fd in fds:\n    try:\n        os.write(fd, {FORGED!r})\n"
               "    except OSError:\n        pass\n"
               "def add(a, b):\n    return 0\n")
    res = judged(program)
    assert not res.passed and res.kind == "failed", res
    if forged != "status":  # the forged lines reached the call pipe: the protocol broke, the call failed
        assert "broke the call protocol" in res.detail
    right = judged(program.replace("return 0", "return a + b"))  # writes reaching the pipe fail even right answers
    assert right.passed == (forged == "status")


EXITS = {"sys.exit(0)": "import sys\nsys.exit(0)", "os._exit(0)": "import os\nos._exit(0)",
         "kill itself": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
         "kill its parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
         "kill its group": "import os, signal\nos.killpg(os.getpgid(0), signal.SIGKILL)",
         "kill every process it may": "import os, signal\nos.kill(-1, signal.SIGKILL)\nos._exit(0)",
         "stop itself": "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)"}


@needs_kernel
@pytest.mark.parametrize("where", ["at its start", "inside the call"])
@pytest.mark.parametrize("how", list(EXITS))
def test_leaving_before_the_tests_finish_fails_kernel_only(how, where):
    # guard off: the kernel alone (pid namespace, own uids) keeps the signals inside the program's own processes
    code = EXITS[how]
    if where == "at its start":
        program = f"{code}\ndef add(a, b):\n    return a + b\n"
    else:
        program = "def add(a, b):\n" + "".join(f"    {line}\n" for line in code.splitlines()) + "    return a + b\n"
    res = run(program, LIMITS, guard=False, test=ADD_TEST)
    assert res.kind in ("failed", "timeout") and not res.passed, res
    assert run("print(6 * 7)", LIMITS).stdout == "42\n"  # the next sandbox starts as ever
    assert sandbox_processes() == []


def test_leaving_early_with_the_guard_is_refused_or_failed():
    for how, code in EXITS.items():
        res = judged(f"{code}\ndef add(a, b):\n    return a + b\n")
        assert res.kind in ("failed", "blocked:process"), (how, res)


ALWAYS_EQUAL = {  # each defines Any(): what add returns
    "__eq__ always True": "class Any:\n    def __eq__(self, other):\n        return True\n",
    "int subclass": "class Any(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n",
    "str subclass": "class Any(str):\n    def __eq__(self, other):\n        return True\n    __hash__ = str.__hash__\n",
    "inside a list": "class One:\n    def __eq__(self, other):\n        return True\ndef Any():\n    return [One()]\n",
}


@pytest.mark.parametrize("kind", list(ALWAYS_EQUAL))
def test_results_that_equal_anything_never_reach_the_test(kind):
    res = judged(ALWAYS_EQUAL[kind] + "def add(a, b):\n    return Any()\n")
    assert res.kind == "failed" and "not plain data" in res.detail, res


PATCHES = {  # a patch in the program's process, and a check it would have turned into a pass in one interpreter
    "builtins.abs": ("import builtins\nbuiltins.abs = lambda x: 0", "assert abs(add(0.5, 0) - 2.0) < 1e-9"),
    "builtins.isinstance": ("import builtins\nbuiltins.isinstance = lambda *a: True", "assert isinstance(add(1, 1), str)"),
    "operator.eq": ("import operator\noperator.eq = lambda a, b: True", "import operator\nassert operator.eq(add(1, 1), 5)"),
    "AssertionError": ("import builtins\nbuiltins.AssertionError = type('AssertionError', (Warning,), {})",
                       "if add(1, 1) != 7:\n    raise AssertionError('wrong')"),
    "the harness": ("import sys\nmain = sys.modules['__main__']\n"  # the sandbox's own functions in its process
                    "main.classify = lambda *a, **k: ('passed', None, None, '', '')\nmain.report = lambda *a, **k: None",
                    "assert add(1, 1) == 7"),
}


@pytest.mark.parametrize("patched", list(PATCHES))
def test_patched_builtins_operator_and_harness_stay_in_the_programs_process(patched):
    patch, check = PATCHES[patched]
    program = f"{patch}\ndef add(a, b):\n    return a + b\n"
    res = judged(program, Test(check))
    assert res.kind == "failed" and res.detail.startswith("AssertionError"), res
    assert judged(program, ADD_TEST).passed  # the same program, judged on what it returns
    everything = "\n".join(p for p, _ in PATCHES.values()) + "\nimport builtins\nbuiltins.len = lambda x: 3\n"
    assert judged(everything + program, Test(check)).kind == "failed"  # len patched: it cannot even answer


def test_exceptions_of_the_program_reach_the_test_as_themselves_but_stop_iteration():
    # StopIteration raised by the program is not the test's loop ending early: it fails the call
    stop = judged("def add(a, b):\n    raise StopIteration\n", Test("for got in map(add, [1], [2]):\n    assert got == 7\n"))
    assert stop.kind == "failed" and stop.detail == "ProgramError: the program raised StopIteration: "
    # exceptions the test expects arrive as themselves
    expected = judged("def add(a, b):\n    raise ValueError('no')\n",
                      Test("try:\n    add(1, 2)\n    raise AssertionError\nexcept ValueError as e:\n"
                           "    assert 'no' in str(e)\n"))
    assert expected.passed


@needs_kernel
def test_the_checker_is_out_of_the_programs_reach_kernel_only():
    # guard off, ctypes on: the checker (pid 1 here, its own uid, not dumpable) cannot be traced or signalled
    program = ("import ctypes, os, signal\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               "attached = libc.ptrace(16, 1, 0, 0)\n"  # PTRACE_ATTACH to the checker
               "try:\n    os.kill(1, signal.SIGSTOP)\nexcept OSError:\n    pass\n"
               "def add(a, b):\n    return attached\n")
    res = run(program, LIMITS, guard=False, test=Test("assert add(1, 2) == -1 and add(0, 0) == -1"))
    assert res.passed, res  # ptrace failed (-1), and the checker still ran to its end
    assert run(program, LIMITS, guard=False, test=ADD_TEST).kind == "failed"


@needs_kernel
def test_the_program_reads_nothing_but_its_folder_and_the_interpreter(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_SANDBOX_SECRET", "do-not-leak")
    home = Path(f"/tmp/kiln-home-{uuid.uuid4().hex}")  # a Kiln home others may read, as the MLflow database's is
    try:
        home.mkdir(mode=0o755)
        secret = home / "mlflow.db"
        secret.write_text("SQLite format 3 secret-runs")
        secret.chmod(0o644)
        readable = [str(secret), str(Path(__file__).resolve()), "/etc/passwd", "/proc/self/environ", "/proc/1/environ",
                    f"/proc/{os.getpid()}/environ", "/root/.bashrc", str(Path.home() / ".cache")]
        program = ("import os, sys\n"
                   f"for path in {readable!r}:\n"
                   "    try:\n        print('GOT:', path, open(path, 'rb').read(40))\n"
                   "    except OSError as e:\n        print('no', path, type(e).__name__)\n"
                   "print(sorted(os.listdir('/')))\nprint(os.listdir('/root') if os.path.exists('/root') else [])\n"
                   "print(sorted(os.environ))\n")
        for guard in GUARDS:
            res = run(program, LIMITS, guard=guard)
            assert res.passed and "GOT:" not in res.stdout and "secret" not in res.stdout, res.stdout
            lines = res.stdout.splitlines()
            top = set(eval(lines[-3]))
            assert top <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "root", "sbin", "tmp", "usr"}, top
            assert not {"proc", "sys", "home", "work", "var", "opt"} & top
            interpreter = {Path(d).parts[2] for d in (sys.base_prefix, sys.prefix) if d.startswith("/root/")}
            assert set(eval(lines[-2])) <= interpreter  # /root shows the way to the interpreter, nothing else
            assert eval(lines[-1]) == ["HOME", "LANG", "LC_ALL", "OMP_NUM_THREADS", "PATH", "TMPDIR"]
        res = run(f"print(open({str(secret)!r}).read())", LIMITS, guard=False)
        assert res.kind == "blocked:filesystem" and "secret" not in res.stdout + res.stderr + res.detail
    finally:
        secret.unlink(missing_ok=True)
        home.rmdir()


def test_the_tests_text_is_nowhere_in_the_programs_process():
    marker = f"answer-{uuid.uuid4().hex}"
    program = ("import gc, os, sys\nneedle = ''.join(reversed(%r))\n"
               "def leaked():\n"
               "    seen = []\n    frame = sys._getframe()\n"
               "    while frame:\n        seen += list(frame.f_locals.values())\n        frame = frame.f_back\n"
               "    for o in gc.get_objects():\n"
               "        seen += list(o.values()) if type(o) is dict else list(o) if type(o) in (list, tuple) else []\n"
               "    seen += list(sys.orig_argv)\n"
               "    for fd in range(5, 64):\n"
               "        try:\n            seen.append(os.pread(fd, 1 << 16, 0))\n        except OSError:\n            pass\n"
               "    hits = [s for s in seen if s is not needle and isinstance(s, (str, bytes))\n"
               "            and needle.encode() in (s if isinstance(s, bytes) else s.encode('utf-8', 'replace'))]\n"
               "    return len(hits)\n") % marker[::-1]
    res = judged(program, Test(f"assert leaked() == 0, 'the program saw the test'\nMARKER = {marker!r}\n"))
    assert res.passed, res


@pytest.mark.parametrize("guard", GUARDS, ids=lambda g: "guard" if g else "kernel-only")
def test_the_folder_has_a_total_quota_and_tmp_and_shm_take_nothing(guard):
    fill = "for i in range(250):\n    with open(f'part{i}', 'wb') as f:\n        f.write(bytes(8 << 20))\n"  # 2 GB
    t0 = time.perf_counter()
    res = run(fill, replace(LIMITS, cpu_s=3, timeout_s=10), guard=guard)
    if KERNEL:
        assert res.kind == "killed:disk" and res.detail == "OSError: [Errno 28] No space left on device", res
        assert time.perf_counter() - t0 < 5
        size = run("import os\nst = os.statvfs('.')\nprint(st.f_blocks * st.f_frsize >> 20)", LIMITS)
        assert size.stdout == f"{LIMITS.disk_mb}\n"
        assert run("import os\nprint(os.statvfs('.').f_files)", replace(LIMITS, disk_mb=1)).stdout == "10000\n"
    for place in ("/tmp", "/dev/shm"):
        name = f"kiln-fill-{uuid.uuid4().hex}"
        res = run(f"with open('{place}/{name}', 'wb') as f:\n    f.write(bytes(1 << 20))", LIMITS, guard=guard)
        assert res.kind == "blocked:filesystem" and not Path(place, name).exists(), res


def test_mode_none_scores_only_when_asked_to():
    with pytest.raises(SandboxError, match=r"only the in-process guard isolates programs here .*allow_guard_only=True"):
        run("def add(a, b):\n    return a + b\n", LIMITS, mode="none", test=ADD_TEST)
    with pytest.raises(SandboxError, match=r"only the in-process guard"):
        run_many(["pass"], LIMITS, mode="none", tests=[ADD_TEST])
    try:
        res = run("def add(a, b):\n    return a + b\n", LIMITS, mode="none", test=ADD_TEST, allow_guard_only=True)
    except SandboxError as e:  # as root with the interpreter in a closed folder: never run programs as uid 0
        assert os.geteuid() == 0 and "runs programs as a uid that owns nothing" in str(e)
    else:
        assert (res.kind, res.isolation, res.checked) == ("passed", "none", True)
