"""The sandbox's child side: isolate itself, drop privileges, run one untrusted program, say how it ended.

Never imported: ``kiln.evaluation.sandbox`` runs this file's text as ``python -I -S -c <text> key=value ...`` (read
that module first). Standard library only, and none of json, re, enum or signal (``_signal`` is built in): each import is paid on
every sample.
Events go to the status descriptor as JSON lines: ``setup``, ``setup_failed``, ``refused`` (a call the guard stopped),
``result`` (the program's own end) and ``exit`` (how its process ended, ``timed_out`` where this process killed it
at the wall timeout).
"""

import builtins
import ctypes
import errno
import os
import resource
import sys
import _signal
from _json import encode_basestring_ascii as _quote

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
# per-mount flags a read-only remount keeps (a user namespace may not clear them: "locked" flags)
KEEP = {"nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21,
        "strictatime": 1 << 24}
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, CAP_VERSION_3, SIGKILL = 1, 38, 0x20080522, 9
# modules the guard refuses to import, by what they would reach; the kernel layers stop the same things below it
BLOCKED = {"socket": "network", "_socket": "network", "ssl": "network", "_ssl": "network",
           "subprocess": "process", "_posixsubprocess": "process", "multiprocessing": "process",
           "_multiprocessing": "process", "pty": "process", "resource": "process", "ctypes": "native", "_ctypes": "native"}
# os functions the guard refuses outright: other processes, privileges, descriptors that may point outside the folder
REFUSED = {"process": ("system", "popen", "fork", "forkpty", "execv", "execve", "execl", "execle", "execlp", "execlpe",
                       "execvp", "execvpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl", "spawnle", "spawnlp",
                       "spawnlpe", "posix_spawn", "posix_spawnp", "kill", "killpg", "setsid", "setpgid", "setpgrp",
                       "setuid", "seteuid", "setreuid", "setresuid", "setgid", "setegid", "setregid", "setresgid",
                       "setgroups", "initgroups", "pidfd_open"),
           "filesystem": ("chroot", "fchdir", "fchmod", "fchown")}
# os functions that change the filesystem: allowed on paths inside the folder only; value: how many leading
# arguments are paths (symlink's first argument is the link's text, not a place written)
CHECKED = {"remove": 1, "unlink": 1, "rmdir": 1, "mkdir": 1, "rename": 2, "renames": 2, "replace": 2, "link": 2,
           "truncate": 1, "chmod": 1, "lchmod": 1, "chown": 1, "lchown": 1, "utime": 1, "mkfifo": 1, "mknod": 1,
           "setxattr": 1, "removexattr": 1, "chflags": 1, "lchflags": 1, "chdir": 1, "removedirs": 1}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
NET_ERRNOS = {errno.ENETUNREACH, errno.ENETDOWN, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT}
MAX_NOTES = 20

libc = ctypes.CDLL(None, use_errno=True)
_write, _exit = os.write, os._exit  # the wrapper's own, kept before the guard replaces anything


class SetupError(Exception):
    """An isolation step failed; the message names the step and the system error."""


class Refused(PermissionError):
    """A call the guard refused; ``category`` is filesystem, network, process or native."""

    def __init__(self, category, what):
        super().__init__(errno.EPERM, f"sandbox refused {what} ({category})")
        self.category = category


class RefusedImport(ImportError):
    """An import the guard refused; ``category`` as for Refused."""

    def __init__(self, category, name):
        super().__init__(f"sandbox refused import of {name!r} ({category})", name=name)
        self.category = category


def _json(value):
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value) if isinstance(value, (int, float)) else _quote(str(value))


def report(fd, event, **fields):
    fields = {"event": event, "pid": os.getpid(), **fields}
    try:
        _write(fd, ("{" + ",".join(f"{_quote(k)}:{_json(v)}" for k, v in fields.items()) + "}\n").encode())
    except Exception:  # a full or limited status file must not change how the program ended
        pass


def _check(rc, what):
    if rc != 0:
        e = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(e)} (errno {e})")


def _mount(source, target, fstype, flags, data=None):
    enc = (lambda s: None if s is None else os.fsencode(s))
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _unescape(field):
    """A mountinfo path: spaces, tabs, newlines and backslashes come octal-escaped."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _mounts():
    """(mount point, per-mount options) of this mount namespace."""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return [(_unescape(p[4]), p[5].split(",")) for p in (line.split() for line in f) if len(p) > 5]


def _reveal(paths):
    """Make the interpreter reachable for a uid that owns nothing: a folder on its way that others may not enter
    (pyenv under /root, mode 0700) is covered by an empty tmpfs holding only the needed child, bound back in.
    The rest of that folder stays hidden from the program."""
    covers = {}
    for path in paths:
        cur = "/"
        for name in [p for p in path.split("/") if p]:
            if not os.stat(cur).st_mode & 0o001:
                covers.setdefault(cur, set()).add(name)
            cur = os.path.join(cur, name)
    for cur in sorted(covers, key=lambda p: p.count("/")):
        fds = {n: os.open(os.path.join(cur, n), os.O_PATH) for n in covers[cur]}  # before the tmpfs hides them
        _mount("tmpfs", cur, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
        for name, fd in fds.items():
            target = os.path.join(cur, name)
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.mkdir(target, 0o755)
            else:
                os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
            _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
            os.close(fd)


def _read_only(folder):
    """Remount every mount of this namespace read-only except the folder's own bind mount."""
    for point, options in _mounts():
        if point == folder or "ro" in options:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
        for option in options:
            flags |= KEEP.get(option, 0)
        _mount(None, point, None, flags)


def _write_file(path, text):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _namespaces(cfg):
    """New mount, network, pid and IPC namespaces (and a user namespace unless root); the whole filesystem
    read-only but the folder; no network interface but a loopback that is down."""
    user = cfg["mode"] == "user"
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | (CLONE_NEWUSER if user else 0)
    _check(libc.unshare(flags), "unshare")
    if user:  # map our own ids only: the one mapping an unprivileged process may write
        _write_file("/proc/self/setgroups", "deny")
        _write_file("/proc/self/uid_map", f"{uid} {uid} 1")
        _write_file("/proc/self/gid_map", f"{gid} {gid} 1")
    folder = cfg["folder"]
    _mount("none", "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    _mount(folder, folder, None, MS_BIND)  # its own mount, left writable when everything else turns read-only
    if cfg["uid"] is not None:
        _reveal(interpreter_dirs())
    _read_only(folder)


def _limits(cfg):
    mb = 1 << 20
    # CPU: SIGKILL at the limit itself; pid 1 of a namespace ignores the SIGXCPU a lower soft limit would send first
    for name, soft, hard in (("RLIMIT_CPU", cfg["cpu_s"], cfg["cpu_s"]),
                             ("RLIMIT_AS", cfg["memory_mb"] * mb, cfg["memory_mb"] * mb),
                             ("RLIMIT_FSIZE", cfg["file_size_mb"] * mb, cfg["file_size_mb"] * mb),
                             ("RLIMIT_NOFILE", cfg["open_files"], cfg["open_files"]),
                             ("RLIMIT_NPROC", cfg["nproc"], cfg["nproc"]),
                             ("RLIMIT_CORE", 0, 0)):
        try:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        except (ValueError, OSError) as e:
            raise SetupError(f"setrlimit {name}({soft}, {hard}): {e}") from None


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop(cfg):
    """Become the sandbox's own uid (as root), give up every capability, never gain any again."""
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
    data = (_CapData * 2)()  # all zero: no capabilities, including those a user namespace gave us
    _check(libc.capset(ctypes.byref(_CapHeader(CAP_VERSION_3, 0)), data), "capset")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    _check(libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")  # dies with the host's thread


def _guard(folder, note):
    """The second layer, inside the program's interpreter: writes outside the folder, other processes, sockets
    and native code are refused with Refused/RefusedImport, each noted. It is not a security boundary on its own
    (a determined program can reach the originals); the kernel layers below it are."""
    import _imp
    import io

    realpath, fsdecode = os.path.realpath, os.fsdecode

    def inside(path):
        if isinstance(path, int):  # an open descriptor: checked when it was opened
            return True
        p = realpath(fsdecode(path))
        return p == folder or p.startswith(folder + "/")

    def refuse(category, what):
        note(category, what)
        raise Refused(category, what)

    def refuser(category, name):
        def refused(*args, **kwargs):
            refuse(category, f"os.{name}")
        return refused

    def checked(name, fn, n_paths):
        def call(*args, **kwargs):
            if any(kwargs.get(k) is not None for k in ("dir_fd", "src_dir_fd", "dst_dir_fd")):
                refuse("filesystem", f"os.{name} relative to a directory descriptor")
            for path in [*args[:n_paths], *(kwargs[k] for k in ("path", "src", "dst", "name") if k in kwargs)]:
                if not inside(path):
                    refuse("filesystem", f"os.{name}({path!r}) outside the folder")
            return fn(*args, **kwargs)
        return call

    def writes(mode):
        return isinstance(mode, str) and any(c in mode for c in "wax+")

    real_open, real_os_open, real_symlink = io.open, os.open, os.symlink

    def open_(file, mode="r", *args, **kwargs):
        if writes(mode) and not inside(file):
            refuse("filesystem", f"open({file!r}, {mode!r}) outside the folder")
        return real_open(file, mode, *args, **kwargs)

    def os_open(path, flags, *args, dir_fd=None, **kwargs):
        if flags & WRITE_FLAGS and (dir_fd is not None or not inside(path)):
            refuse("filesystem", f"os.open({path!r}) for writing outside the folder")
        return real_os_open(path, flags, *args, dir_fd=dir_fd, **kwargs)

    def symlink(src, dst, *args, dir_fd=None, **kwargs):  # the link's text may name anything; its place may not
        if dir_fd is not None or not inside(dst):
            refuse("filesystem", f"os.symlink to {dst!r} outside the folder")
        return real_symlink(src, dst, *args, **kwargs)

    class FileIO(io.FileIO):
        def __init__(self, file, mode="r", *args, **kwargs):
            if writes(mode) and not inside(file):
                refuse("filesystem", f"FileIO({file!r}, {mode!r}) outside the folder")
            super().__init__(file, mode, *args, **kwargs)

    import _io
    import posix
    for module in (os, posix):
        for category, names in REFUSED.items():
            for name in names:
                if hasattr(module, name):
                    setattr(module, name, refuser(category, name))
        for name, n_paths in CHECKED.items():
            if hasattr(module, name):
                setattr(module, name, checked(name, getattr(module, name), n_paths))
        module.open, module.symlink = os_open, symlink
    builtins.open = io.open = _io.open = open_
    io.FileIO = _io.FileIO = FileIO

    class Blocker:
        @staticmethod
        def find_spec(name, path=None, target=None):
            top = name.partition(".")[0]
            if top in BLOCKED:
                note(BLOCKED[top], f"import {name}")
                raise RefusedImport(BLOCKED[top], name)
            return None

    def no_loading(create):  # importlib's file and builtin loaders end here: a module loaded by hand too
        def call(spec, *args):
            top = spec.name.partition(".")[0]
            if top in BLOCKED:
                note(BLOCKED[top], f"load {spec.name}")
                raise RefusedImport(BLOCKED[top], spec.name)
            return create(spec, *args)
        return call

    for name in [m for m in sys.modules if m.partition(".")[0] in BLOCKED]:
        del sys.modules[name]  # the wrapper's own ctypes/resource: the program imports them afresh, and is refused
    sys.meta_path.insert(0, Blocker)
    _imp.create_dynamic = no_loading(_imp.create_dynamic)
    _imp.create_builtin = no_loading(_imp.create_builtin)


def _thread_limit():
    """Which limit stopped a new thread: memory when another 8 MiB stack would not fit, else processes."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        return "memory" if size + (8 << 20) > resource.getrlimit(resource.RLIMIT_AS)[0] else "processes"
    except (OSError, StopIteration, ValueError):
        return "processes"


def classify(e, notes):
    """How a program that raised ``e`` ended: (outcome, limit, blocked, by, detail)."""
    detail = (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)[:500]
    category = getattr(e, "category", None)
    if isinstance(e, (Refused, RefusedImport)) and category:
        return "blocked", None, category, "guard", detail
    if isinstance(e, MemoryError):
        return "killed", "memory", None, "kernel", detail
    if isinstance(e, RuntimeError) and "can't start new thread" in str(e):  # EAGAIN: no task left, or no stack
        return "killed", _thread_limit(), None, "kernel", detail
    if isinstance(e, OSError):
        if e.errno == errno.EFBIG:
            return "killed", "file_size", None, "kernel", detail
        if e.errno == errno.EMFILE:
            return "killed", "open_files", None, "kernel", detail
        if e.errno == errno.EAGAIN and not isinstance(e, (TimeoutError, InterruptedError)):
            return "killed", "processes", None, "kernel", detail
        if e.errno in NET_ERRNOS:
            return "blocked", None, "network", "kernel", detail
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return "blocked", None, "filesystem" if e.filename else "process", "kernel", detail
    if notes:  # the program caught a refusal and failed another way
        return "blocked", None, notes[0], "guard", detail
    if isinstance(e, SystemExit):
        return "failed", None, None, "", f"the program exited (SystemExit {e.code!r}) before its tests finished"
    return "failed", None, None, "", detail


def _print_error(e):
    try:
        import traceback
        text = "".join(traceback.format_exception(e))
    except BaseException:  # no memory or descriptors left to import with
        text = f"{type(e).__name__}: {e}\n"
    try:
        _write(2, text[-4000:].encode("utf-8", "replace"))
    except OSError:
        pass


def run_program(code, cfg, status):
    """The program's process (pid 1 of its pid namespace where there is one): guard, run, report, exit."""
    me, notes = os.getpid(), []
    libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)  # dies with the wrapper, and with it the namespace

    def note(category, what):
        notes.append(category)
        if len(notes) <= MAX_NOTES:
            report(status, "refused", category=category, what=what[:300])

    if cfg["guard"]:
        _guard(cfg["folder"], note)
    try:
        exec(code, {"__name__": "sandbox_program", "__builtins__": builtins})
        outcome = ("passed", None, None, "", "")
    except BaseException as e:
        if os.getpid() != me:  # a forked copy of the program: only the program's own process reports
            _exit(1)
        outcome = classify(e, notes)
        _print_error(e)
    if os.getpid() != me:
        _exit(0)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    report(status, "result", **dict(zip(("outcome", "limit", "blocked", "by", "detail"), outcome)))
    _exit(0 if outcome[0] == "passed" else 1)


def interpreter_dirs():
    """Folders this interpreter is started and imports from (the host's function of the same name agrees)."""
    exe = sys.executable
    dirs = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.abspath(exe)),
            os.path.dirname(os.path.realpath(exe))}
    return sorted(os.path.realpath(d) for d in dirs)


def config(args):
    """key=value arguments: text, integers, yes/no, "none"."""
    cfg = {}
    for arg in args:
        key, _, value = arg.partition("=")
        cfg[key] = {"yes": True, "no": False, "none": None}.get(value, int(value) if value.lstrip("-").isdigit() else value)
    return cfg


def main():
    cfg = config(sys.argv[1:])
    status = cfg["status_fd"]
    try:
        if cfg["mode"] in ("root", "user"):
            _namespaces(cfg)
        os.chdir(cfg["folder"])  # after the folder's bind mount: the old directory would stay read-only
        _limits(cfg)
        _drop(cfg)
    except (SetupError, OSError) as e:
        report(status, "setup_failed", error=str(e))
        _exit(3)
    report(status, "setup", mode=cfg["mode"], uid=os.getuid())
    try:
        with open("program.py", encoding="utf-8") as f:
            code = compile(f.read(), "program.py", "exec")
    except BaseException as e:  # a syntax error (or a program too large for the limits) is the program's failure
        _print_error(e)
        report(status, "result", outcome="failed", limit=None, blocked=None, by="", detail=f"{type(e).__name__}: {e}"[:500])
        _exit(1)
    pid = os.fork()
    if pid == 0:
        run_program(code, cfg, status)
    expired = []

    def expire(*_):  # the wall timeout: kill the program here, so that this process reaps it (no orphan left)
        expired.append(True)
        os.kill(pid, SIGKILL)  # still our child, reaped or not: its pid cannot have been reused

    _signal.signal(_signal.SIGALRM, expire)
    _signal.setitimer(_signal.ITIMER_REAL, cfg["timeout_ms"] / 1000)
    _, wait_status, usage = os.wait4(pid, 0)
    _signal.setitimer(_signal.ITIMER_REAL, 0)
    report(status, "exit", timed_out=bool(expired), code=os.WEXITSTATUS(wait_status) if os.WIFEXITED(wait_status) else None,
           signal=os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else None,
           cpu_s=round(usage.ru_utime + usage.ru_stime, 3), max_rss_mb=round(usage.ru_maxrss / 1024, 1))
    _exit(0)


if __name__ == "__main__":
    main()
