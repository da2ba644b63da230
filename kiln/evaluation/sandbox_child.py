"""The sandbox's child side: isolate, then run an untrusted program and the trusted test that judges it in two processes.

Never imported: ``kiln.evaluation.sandbox`` compiles this file once and runs it as ``python -I -S -c BOOT key=value
...``, BOOT loading the compiled code from the input descriptor (read that module first). Standard library only, and
none of json, re, enum or signal (``_signal`` is built in): each import is paid on every sample.

Three processes, each forked from the one before any program code exists:

- the wrapper (this process, privileged): makes the namespaces and a new root holding only the interpreter's files and
  the program's folder, forks the two below, keeps the wall clock, and alone writes to the host's status descriptor
  (JSON lines: ``setup``, ``setup_failed``, ``refused``, ``verdict``, ``exit``).
- the checker (pid 1 of the pid namespace, a uid of its own, not dumpable): runs the trusted ``setup`` and ``test``
  read from the input descriptor. Each of the program's names the test uses is bound to a proxy: a call sends its
  arguments to the program's process as plain data over a pipe and takes the return value back as plain data, so no
  object of the program's (an ``__eq__`` that is always True, an int subclass) ever reaches the test. The checker
  alone decides passed, and tells the wrapper on a pipe only the two of them hold.
- the program's process (another uid, every limit, capabilities dropped, the guard): runs the program, then answers
  calls. It holds stdin (empty), stdout, stderr and its two ends of the call pipes, nothing else: not the status or
  verdict descriptors, not the input file, and never the test's text (the wrapper does not read it).

Plain data: None, bool, int, float, complex, str, bytes, and list, tuple, set, frozenset and dict of plain data, exact
types only, nested at most MAX_DEPTH deep, in the tagged encoding of ``encode``/``decode`` (hand-written: json has no
tuples, sets, bytes or non-string keys and costs an import of re per sample; pickle and marshal are not safe to load).
Messages are a 4-byte length and one encoded tuple, at most MAX_MESSAGE bytes.
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
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 8192, 16384, 1 << 18)
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41}  # no glibc wrapper; elsewhere: move the mount and chroot
# per-mount flags a read-only remount keeps (a user namespace may not clear them: "locked" flags)
KEEP = {"nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21,
        "strictatime": 1 << 24}
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, CAP_VERSION_3, SIGKILL = 1, 4, 38, 0x20080522, 9
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")  # bound into the new root; nothing else of /dev
FOLDER_INODES = 10_000  # files and folders the program's folder may hold
MAX_DEPTH, MAX_MESSAGE = 100, 16 << 20
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
ENDED = "the program's process ended before its tests finished"
# exceptions of the program's that the checker raises as themselves (a test may expect one); any other arrives as
# ProgramError. Never StopIteration: raised inside a map() a for loop takes it for the end and skips the checks.
RAISED_AS = ("ArithmeticError", "AssertionError", "AttributeError", "IndexError", "KeyError", "LookupError",
             "NotImplementedError", "OverflowError", "RecursionError", "RuntimeError", "TypeError", "ValueError",
             "ZeroDivisionError")

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


class NotPlain(TypeError):
    """A value that is not plain data (see the module docstring), or nested too deep."""


class ProgramError(Exception):
    """In the checker: the program raised an exception that RAISED_AS does not name."""


class ProgramGone(BaseException):
    """In the checker: the program's process ended or broke the call protocol; the test fails even if it catches this."""


# ---------------------------------------------------------------------------------------------------- plain data

_CONTAINERS = {list: b"l", tuple: b"t", set: b"S", frozenset: b"z"}
_BUILD = {b"l": list, b"t": tuple, b"S": set, b"z": frozenset}


def encode(value, out=None, depth=0):
    """Plain data as bytes: N, T, F; i<hex>; f<float.hex>; c<re>;<im>; s<n>:<utf-8>; b<n>:<bytes>; l/t/S/z<n>; items;
    d<n>; keys and values. Raises NotPlain for anything else, subclasses included."""
    top = out is None
    out = [] if top else out
    kind = type(value)
    if depth > MAX_DEPTH:
        raise NotPlain(f"plain data nested more than {MAX_DEPTH} deep")
    if value is None:
        out.append(b"N")
    elif kind is bool:
        out.append(b"T" if value else b"F")
    elif kind is int:
        out.append(b"i%x;" % value)
    elif kind is float:
        out.append(b"f" + value.hex().encode() + b";")
    elif kind is complex:
        out.append(b"c" + value.real.hex().encode() + b";" + value.imag.hex().encode() + b";")
    elif kind is str:
        data = value.encode("utf-8", "surrogatepass")
        out.append(b"s%d:" % len(data) + data)
    elif kind is bytes:
        out.append(b"b%d:" % len(value) + value)
    elif kind in _CONTAINERS:
        items = list(value)
        out.append(_CONTAINERS[kind] + b"%d;" % len(items))
        for item in items:
            encode(item, out, depth + 1)
    elif kind is dict:
        pairs = list(value.items())
        out.append(b"d%d;" % len(pairs))
        for k, v in pairs:
            encode(k, out, depth + 1)
            encode(v, out, depth + 1)
    else:
        raise NotPlain(f"a {kind.__name__} is not plain data (None, bool, int, float, complex, str, bytes, and lists, "
                       "tuples, sets and dicts of them)")
    return b"".join(out) if top else None


def decode(data):
    """The value ``encode`` made of ``data``; ValueError (or TypeError: an unhashable key) when data is anything else."""
    pos = 0

    def until(stop):
        nonlocal pos
        end = data.index(stop, pos)
        text = data[pos:end].decode("ascii")
        pos = end + 1
        return text

    def count(stop):
        n = int(until(stop))
        if not 0 <= n <= len(data) - pos:  # every item takes at least one byte
            raise ValueError(f"bad length {n} at byte {pos}")
        return n

    def value(depth):
        nonlocal pos
        if depth > MAX_DEPTH:
            raise ValueError(f"nested more than {MAX_DEPTH} deep")
        tag = data[pos:pos + 1]
        pos += 1
        if tag in (b"N", b"T", b"F"):
            return {b"N": None, b"T": True, b"F": False}[tag]
        if tag == b"i":
            return int(until(b";"), 16)
        if tag == b"f":
            return float.fromhex(until(b";"))
        if tag == b"c":
            return complex(float.fromhex(until(b";")), float.fromhex(until(b";")))
        if tag in (b"s", b"b"):
            n = count(b":")
            chunk, pos = data[pos:pos + n], pos + n
            return chunk.decode("utf-8", "surrogatepass") if tag == b"s" else bytes(chunk)
        if tag in _BUILD:
            return _BUILD[tag]([value(depth + 1) for _ in range(count(b";"))])
        if tag == b"d":
            return {value(depth + 1): value(depth + 1) for _ in range(count(b";"))}
        raise ValueError(f"unknown tag {tag!r} at byte {pos - 1}")

    out = value(0)
    if pos != len(data):
        raise ValueError(f"{len(data) - pos} bytes after the value")
    return out


def send(fd, message):
    """One message: a 4-byte length and the encoded tuple."""
    data = encode(message)
    if len(data) > MAX_MESSAGE:
        raise NotPlain(f"a message of {len(data)} bytes, more than {MAX_MESSAGE}")
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[_write(fd, data):]


def _read_exactly(fd, n):
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(fd):
    """The next message's tuple; EOFError when the other end closed, ValueError when it is not a message."""
    n = int.from_bytes(_read_exactly(fd, 4), "big")
    if n > MAX_MESSAGE:
        raise ValueError(f"a message of {n} bytes, more than {MAX_MESSAGE}")
    message = decode(_read_exactly(fd, n))
    if type(message) is not tuple or not message or type(message[0]) is not str:
        raise ValueError("a message is a tuple that starts with its kind")
    return message


# ---------------------------------------------------------------------------------------------------- host reports


def _json(value):
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value) if isinstance(value, (int, float)) else _quote(str(value))


def report(fd, event, **fields):
    fields = {"event": event, "pid": os.getpid(), **fields}
    try:
        _write(fd, ("{" + ",".join(f"{_quote(k)}:{_json(v)}" for k, v in fields.items()) + "}\n").encode())
    except Exception:  # a full status file must not change how the program ended
        pass


# ---------------------------------------------------------------------------------------------------- isolation


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


def _write_file(path, text):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _inside(path, folder):
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _needed():
    """What the interpreter reads after its start: its module folders (sys.path) and the folders of the shared
    libraries it has loaded (libc, libpython, libffi: the extension modules' libraries live beside them), the loader's
    cache, a few devices. Folders inside another are dropped; so is the interpreter's site-packages (see _hidden)."""
    dirs = {os.path.realpath(p) for p in sys.path if os.path.isdir(p)}
    with open("/proc/self/maps", encoding="utf-8") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/") and ".so" in parts[5]:
                dirs.add(os.path.dirname(os.path.realpath(parts[5].rstrip("\n"))))
    dirs = sorted(d for d in dirs if os.path.isdir(d))
    dirs = [d for d in dirs if not any(_inside(d, o) and d != o for o in dirs)]
    files = [p for p in ("/etc/ld.so.cache", *DEVICES) if os.path.exists(p)]
    return dirs, files


def _hidden(dirs):
    """Installed packages under the bound folders (site-packages, dist-packages): covered by an empty tmpfs, so that
    no package data (a benchmark's answers among them) can be read."""
    out = []
    for d in dirs:
        subs = [d] + [os.path.join(d, n) for n in sorted(os.listdir(d)) if n.startswith("python")]
        out += [os.path.join(s, n) for s in subs for n in ("site-packages", "dist-packages")
                if os.path.isdir(os.path.join(s, n))]
    return out


def _pivot(root):
    """Make ``root`` this mount namespace's root and detach the old one (or, without pivot_root, move it over / and
    chroot: the old mounts stay below, out of reach of a process without capabilities)."""
    os.chdir(root)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is not None and libc.syscall(number, b".", b".") == 0:
        _check(libc.umount2(b".", MNT_DETACH), "umount the old root")
    else:
        _mount(root, "/", None, MS_MOVE)
        _check(libc.chroot(b"."), "chroot")
    os.chdir("/")


def _new_root(cfg):
    """A new root on a read-only tmpfs over the host's folder path: the interpreter's files bound read-only at their
    own paths (installed packages hidden), the devices of DEVICES, empty read-only /tmp and /dev/shm, and the program's
    folder at the host folder's path: a tmpfs of disk_mb (FOLDER_INODES files), the one writable place, gone with the
    namespace."""
    root = folder = cfg["folder"]
    dirs, files = _needed()
    hidden = _hidden(dirs)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m,nr_inodes=4096")
    for name in sorted(os.listdir("/")):  # /lib -> usr/lib and the like: the loader's paths go through them
        if os.path.islink("/" + name):
            os.symlink(os.readlink("/" + name), os.path.join(root, name))
    for path in dirs + files:
        target = root + path
        if path in dirs:
            os.makedirs(target, 0o755, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
        _mount(path, target, None, MS_BIND | MS_REC)
    for path in hidden:
        _mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "mode=0755,size=4k,nr_inodes=1")
    for path in ("/tmp", "/dev/shm", folder):
        os.makedirs(root + path, 0o755, exist_ok=True)
    owner = cfg["uid"] if cfg["uid"] is not None else os.getuid()
    group = cfg["gid"] if cfg["gid"] is not None else os.getgid()
    _mount("tmpfs", root + folder, "tmpfs", MS_NOSUID | MS_NODEV,
           f"mode=0700,size={cfg['disk_mb']}m,nr_inodes={FOLDER_INODES},uid={owner},gid={group}")
    for point, options in _mounts():  # all read-only but the folder
        if point == root + folder or not _inside(point, root) or "ro" in options:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
        for option in options:
            flags |= KEEP.get(option, 0)
        _mount(None, point, None, flags)
    _pivot(root)


def _namespaces(cfg):
    """New mount, network, pid and IPC namespaces (and a user namespace unless root), then the new root; the network
    namespace has only a loopback that is down."""
    user = cfg["mode"] == "user"
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | (CLONE_NEWUSER if user else 0)
    _check(libc.unshare(flags), "unshare")
    if user:  # map our own ids only: the one mapping an unprivileged process may write
        _write_file("/proc/self/setgroups", "deny")
        _write_file("/proc/self/uid_map", f"{uid} {uid} 1")
        _write_file("/proc/self/gid_map", f"{gid} {gid} 1")
    _mount("none", "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    _new_root(cfg)


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


def _drop(uid, gid):
    """Become ``uid`` (as root; None keeps the uid), give up every capability, never gain any again, die with the
    wrapper, and let no process of the same uid trace this one or read its memory."""
    if uid is not None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    data = (_CapData * 2)()  # all zero: no capabilities, including those a user namespace gave us
    _check(libc.capset(ctypes.byref(_CapHeader(CAP_VERSION_3, 0)), data), "capset")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    _check(libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")  # after setuid, which clears it
    _check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(DUMPABLE)")


def _only(fds):
    """Keep stdin, stdout, stderr and ``fds`` (moved to 3, 4, ...); close every other descriptor."""
    base = 3 + len(fds) + max([*fds, 2]) + 1
    for i, fd in enumerate(fds):
        os.dup2(fd, base + i)
    os.closerange(3, base)
    for i in range(len(fds)):
        os.dup2(base + i, 3 + i)
    os.closerange(3 + len(fds), 1 << 20)
    return list(range(3, 3 + len(fds)))


# ---------------------------------------------------------------------------------------------------- the guard


def _guard(folder, note):
    """The second layer, inside the program's interpreter: writes outside the folder, other processes, sockets
    and native code are refused with Refused/RefusedImport, each noted. It is not a security boundary on its own
    (a determined program can reach the originals); the kernel layers below it are."""
    _guard_os(folder, note)
    _guard_imports(note)


def _guard_os(folder, note):
    """os, posix and open as the program sees them: REFUSED's calls refused, CHECKED's and every open for writing
    refused outside ``folder``."""
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


def _guard_imports(note):
    """BLOCKED's modules refused at import (a finder first on sys.meta_path) and at load (importlib's file and
    builtin loaders), and dropped from sys.modules where the wrapper itself had loaded them."""
    import _imp

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


# ---------------------------------------------------------------------------------------------------- the program


def _thread_limit():
    """Which limit stopped a new thread: memory when another 8 MiB stack does not fit, else processes."""
    try:
        bytearray(8 << 20)
        return "processes"
    except MemoryError:
        return "memory"


def _outside(filename, folder):
    try:
        return not _inside(os.path.realpath(os.fsdecode(filename)), folder)
    except (TypeError, ValueError):
        return False


def classify(e, notes, folder="/"):
    """How a program that raised ``e`` ended: (outcome, limit, blocked, by, detail). A path outside ``folder`` that
    is not there (the new root holds only the interpreter's files) counts as blocked."""
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
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return "killed", "disk", None, "kernel", detail
        if e.errno == errno.EMFILE:
            return "killed", "open_files", None, "kernel", detail
        if e.errno == errno.EAGAIN and not isinstance(e, (TimeoutError, InterruptedError)):
            return "killed", "processes", None, "kernel", detail
        if e.errno in NET_ERRNOS:
            return "blocked", None, "network", "kernel", detail
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return "blocked", None, "filesystem" if e.filename else "process", "kernel", detail
        if e.errno == errno.ENOENT and e.filename is not None and _outside(e.filename, folder):
            return "blocked", None, "filesystem", "kernel", detail
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


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass


def _message_of(e):
    try:
        return str(e)[:500]
    except BaseException:
        return "(its message could not be read)"


def run_program(text, cfg, requests, replies):
    """The program's process: guard, run the program, say which of the test's names it defines, then answer calls
    until the checker closes its end. Its messages carry only plain data (what the program returned or raised, the
    guard's notes since the last message); the checker decides what they mean."""
    me, notes, refused, sent = os.getpid(), [], [], [0]
    sys.argv[:] = ["program.py"]

    def note(category, what):
        notes.append(category)
        if len(refused) < MAX_NOTES:
            refused.append(f"{category}: {what[:300]}")

    def news():
        out, sent[0] = refused[sent[0]:], len(refused)
        return out

    def reply(message):
        if os.getpid() != me:  # a forked copy of the program: only the program's own process answers
            _exit(0)
        _flush()
        try:
            send(replies, message)
        except NotPlain as e:
            send(replies, ("raise", "TypeError", f"the program returned what cannot be sent: {e}"[:500],
                           ("failed", None, None, "", f"TypeError: {e}"[:500]), news()))

    if cfg["guard"]:
        _guard(cfg["folder"], note)
    scope = {"__name__": "sandbox_program", "__builtins__": builtins}
    try:
        exec(compile(text, "program.py", "exec"), scope)
    except BaseException as e:
        if os.getpid() != me:
            _exit(1)
        _print_error(e)
        reply(("failed", classify(e, notes, cfg["folder"]), news()))
        _exit(1)
    functions, values, modules = [], {}, {}
    for name in cfg["names"]:
        if name not in scope:
            continue
        value = scope[name]
        if type(value) is type(sys):
            modules[name] = value.__name__ if type(value.__name__) is str else ""
        elif callable(value):
            functions.append(name)
        else:
            try:
                encode(value)
                values[name] = value
            except NotPlain:
                pass
    reply(("ready", functions, values, modules, news()))
    while True:
        try:
            message = receive(requests)
        except (EOFError, OSError, ValueError, TypeError):
            _exit(0)
        if len(message) != 4 or message[0] != "call" or type(message[1]) is not str:
            _exit(1)
        _, name, args, kwargs = message
        try:
            result = scope[name](*args, **kwargs)
            encode(result)
        except BaseException as e:
            if os.getpid() != me:
                _exit(1)
            _print_error(e)
            reply(("raise", type(e).__name__, _message_of(e), classify(e, notes, cfg["folder"]), news()))
            continue
        reply(("return", result, news()))


# ---------------------------------------------------------------------------------------------------- the checker


class _ProgramLink:
    """The checker's end of the program's pipes: calls sent, messages read and checked for their shape, the guard's
    notes and the program's first failure report kept, and why the program is gone once it is."""

    SHAPES = {"ready": (5, list, dict, dict), "return": (3,), "raise": (5, str, str, tuple), "failed": (3, tuple)}

    def __init__(self, requests, replies):
        self.requests, self.replies = requests, replies
        self.why, self.report, self.refused = "", None, []

    def gone(self, why):
        self.why = self.why or why
        return ProgramGone(self.why)

    def answer(self):
        try:
            message = receive(self.replies)
        except EOFError:
            raise self.gone(ENDED) from None
        except (OSError, ValueError, TypeError, RecursionError, MemoryError) as e:
            raise self.gone(f"the program broke the call protocol: {type(e).__name__}: {e}"[:500]) from None
        kind, refused = message[0], message[-1]
        shape = self.SHAPES.get(kind)
        if (shape is None or len(message) != shape[0] or type(refused) is not list
                or any(type(v) is not t for v, t in zip(message[1:], shape[1:]))
                or any(type(r) is not str for r in refused)):
            raise self.gone(f"the program broke the call protocol: a {kind[:20]!r} message of the wrong shape")
        self.refused.extend(r[:300] for r in refused[:max(0, MAX_NOTES - len(self.refused))])
        report = message[3] if kind == "raise" else message[1] if kind == "failed" else None
        if report is not None and self.report is None:
            self.report = tuple(str(v)[:500] if v is not None else None for v in (*report[:5], *[None] * 5)[:5])
        return message

    def proxy(self, name):
        """A function that calls the program's ``name`` and returns what it returned or raises what it raised."""
        def call(*args, **kwargs):
            if self.why:
                raise ProgramGone(self.why)
            try:
                send(self.requests, ("call", name, args, kwargs))
            except OSError:
                raise self.gone(ENDED) from None
            message = self.answer()
            if message[0] == "return":
                return message[1]
            if message[0] != "raise":
                raise self.gone(f"the program broke the call protocol: {message[0][:20]!r} answered a call")
            kind = getattr(builtins, message[1], None) if message[1] in RAISED_AS else ProgramError
            raise kind(f"the program raised {message[1][:100]}: {message[2]}")
        call.__name__ = call.__qualname__ = name
        return call


def run_checker(cfg, requests, replies, verdict, source):
    """The checker's process: read the trusted setup and test, bind the program's names, run the test, send the
    verdict (outcome, detail, gone: "ended" when the program's process ended before the test did, "protocol" when it
    sent what is not a message in turn, else ""; the program's own report of its first failure; the guard's notes)."""
    start = cfg["code_bytes"] + cfg["program_bytes"]
    setup = os.pread(source, cfg["setup_bytes"], start).decode("utf-8")
    test = ""
    if cfg["test_bytes"] >= 0:
        test = os.pread(source, cfg["test_bytes"], start + cfg["setup_bytes"]).decode("utf-8")
    os.close(source)
    link = _ProgramLink(requests, replies)
    outcome, detail = "failed", ""
    scope = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(setup, "setup", "exec"), scope)
        hello = link.answer()
        if hello[0] == "failed":
            detail = link.report[4] or "the program failed"
        elif hello[0] != "ready":
            raise link.gone(f"the program broke the call protocol: {hello[0][:20]!r} before it was ready")
        else:
            _, functions, values, modules, _ = hello
            for name in cfg["names"]:
                if name in functions:
                    scope[name] = link.proxy(name)
                elif name in values:
                    scope[name] = values[name]
                elif modules.get(name) == name and name.partition(".")[0] in sys.stdlib_module_names:
                    scope[name] = __import__(name)
            exec(compile(test, "test", "exec"), scope)
            outcome, detail = ("failed", link.why) if link.why else ("passed", "")
    except BaseException as e:
        _print_error(e)
        detail = link.why or (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)[:500]
    _flush()
    gone = "ended" if link.why == ENDED else "protocol" if link.why else ""
    send(verdict, ("verdict", outcome, detail[:500], gone, link.report, link.refused))
    _exit(0)


# ---------------------------------------------------------------------------------------------------- the wrapper


def config(args):
    """key=value arguments: text, integers, yes/no, "none"; ``names`` a comma-separated list."""
    cfg = {}
    for arg in args:
        key, _, value = arg.partition("=")
        cfg[key] = {"yes": True, "no": False, "none": None}.get(value, int(value) if value.lstrip("-").isdigit() else value)
    cfg["names"] = [n for n in str(cfg.get("names") or "").split(",") if n]
    return cfg


def _fork(run, fds):
    """A child that keeps only ``fds`` (as 3, 4, ...) and runs ``run(*new fds)``; it never returns here."""
    pid = os.fork()
    if pid == 0:
        try:
            run(*_only(fds))
        except BaseException as e:
            _print_error(e)
        _exit(3)
    return pid


def _ended(wait_status):
    return {"code": os.WEXITSTATUS(wait_status) if os.WIFEXITED(wait_status) else None,
            "signal": os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else None}


def main():
    cfg = config(sys.argv[1:])
    status, source = cfg["status_fd"], cfg["input_fd"]
    os.umask(0o022)
    libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)  # dies with the host's thread that started it
    try:
        program = os.pread(source, cfg["program_bytes"], cfg["code_bytes"]).decode("utf-8")
        if cfg["mode"] in ("root", "user"):
            _namespaces(cfg)
        os.chdir(cfg["folder"])
        with open("program.py", "w", encoding="utf-8") as f:  # for tracebacks; the program runs from memory
            f.write(program)
        if cfg["uid"] is not None:
            os.chown("program.py", cfg["uid"], cfg["gid"])
        calls, answers, verdicts = os.pipe(), os.pipe(), os.pipe()
    except (SetupError, OSError, UnicodeDecodeError) as e:
        report(status, "setup_failed", error=str(e))
        _exit(3)
    report(status, "setup", mode=cfg["mode"], uid=cfg["uid"], checker_uid=cfg["checker_uid"])

    def checker(requests, replies, verdict, src):
        os.setsid()
        _limits(cfg)
        _drop(cfg["checker_uid"], cfg["checker_uid"])
        os.chdir("/")
        run_checker(cfg, requests, replies, verdict, src)

    def program_process(requests, replies):
        os.setsid()
        _limits(cfg)
        _drop(cfg["uid"], cfg["gid"])
        run_program(program, cfg, requests, replies)

    checker_pid = _fork(checker, [calls[1], answers[0], verdicts[1], source])  # first: pid 1 of the pid namespace
    program_pid = _fork(program_process, [calls[0], answers[1]])
    for fd in (*calls, *answers, verdicts[1], source):
        os.close(fd)
    expired = []

    def expire(*_):  # the wall timeout: kill both here, so that this process reaps them (no orphan left)
        expired.append(True)
        for pid in (checker_pid, program_pid):
            os.kill(pid, SIGKILL)  # still our children, reaped or not: their pids cannot have been reused

    _signal.signal(_signal.SIGALRM, expire)
    _signal.setitimer(_signal.ITIMER_REAL, cfg["timeout_ms"] / 1000)
    ended = {}
    while checker_pid not in ended:
        pid, wait_status, usage = os.wait4(-1, 0)
        ended[pid] = (wait_status, usage)
    for pid in (program_pid, -program_pid):  # the program and its group (outside a pid namespace nothing else ends it)
        try:
            os.kill(pid, SIGKILL)
        except OSError:
            pass
    if program_pid not in ended:
        _, wait_status, usage = os.wait4(program_pid, 0)
        ended[program_pid] = (wait_status, usage)
    _signal.setitimer(_signal.ITIMER_REAL, 0)
    data = b""
    while chunk := os.read(verdicts[0], 1 << 16):
        data += chunk
    try:
        _, outcome, detail, gone, program_report, refused = decode(data[4:])
    except (ValueError, TypeError):
        outcome = None
    if outcome is not None:
        for line in refused:
            category, _, what = line.partition(": ")
            report(status, "refused", category=category, what=what)
        keys = ("outcome", "limit", "blocked", "by", "detail")
        report(status, "verdict", outcome=outcome, detail=detail, gone=gone,
               **{f"program_{k}": v for k, v in zip(keys, program_report or (None,) * 5)})
    (program_status, usage), (checker_status, _) = ended[program_pid], ended[checker_pid]
    checker_end = _ended(checker_status)
    report(status, "exit", timed_out=bool(expired), **_ended(program_status),
           cpu_s=round(usage.ru_utime + usage.ru_stime, 3), max_rss_mb=round(usage.ru_maxrss / 1024, 1),
           checker_code=checker_end["code"], checker_signal=checker_end["signal"])
    _exit(0)


if __name__ == "__main__":
    main()
