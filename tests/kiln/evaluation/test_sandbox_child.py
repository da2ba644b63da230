"""Tests for kiln.evaluation.sandbox_child, in-process where no isolation is needed: the tagged encoding of plain data
(exact bytes, exact types back, subclasses and deep nesting refused, malformed input an error), messages over a pipe,
the key=value command line, the host's JSON status lines, mountinfo unescaping, and how a program's exception is
classified (blocked, killed by a limit, or failed); the isolated processes themselves run in test_sandbox.py.
"""

from __future__ import annotations

import errno
import json
import math
import os

import pytest

from kiln.evaluation import sandbox_child as child
from kiln.evaluation.sandbox_child import NotPlain, Refused, RefusedImport, classify, decode, encode


class Pipe:
    """Both ends of an os.pipe; ``close(fd)`` closes an end once (the fixture closes the rest)."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        self.open = {self.r, self.w}

    def close(self, fd: int) -> None:
        if fd in self.open:
            self.open.discard(fd)
            os.close(fd)


@pytest.fixture
def pipe():
    ends = Pipe()
    yield ends
    for fd in (ends.r, ends.w):
        ends.close(fd)


def test_plain_values_encode_to_their_tags():
    assert [encode(v) for v in (None, True, False, 255, -1, 0)] == [b"N", b"T", b"F", b"iff;", b"i-1;", b"i0;"]
    assert encode(1.5) == b"f0x1.8000000000000p+0;" and encode(2j) == b"c0x0.0p+0;0x1.0000000000000p+1;"
    assert encode("\u00e9") == b"s2:\xc3\xa9" and encode(b"a;b") == b"b3:a;b"
    assert encode([1, (2,)]) == b"l2;i1;t1;i2;" and encode({"a": b"x"}) == b"d1;s1:ab1:x"
    assert encode({3}) == b"S1;i3;" and encode(frozenset()) == b"z0;"


def test_plain_data_comes_back_equal_and_of_the_same_types():
    value = {"ints": [0, -7, 2**100, -(2**70)], "floats": (0.1, -0.0, math.inf, 1e-310), "complex": 3 - 4j,
             "text": ["", "tab\tnew\nline", "\ud800 lone surrogate", "\u2603"], "bytes": b"\x00\xff;:",
             (1, "key"): {frozenset({1, 2}), frozenset()}, None: [True, False, None], 5: set(), "empty": ((), [], {})}
    back = decode(encode(value))
    assert back == value and repr(back) == repr(value)  # repr shows tuple vs list and set vs frozenset
    assert math.copysign(1, back["floats"][1]) == -1.0
    assert math.isnan(decode(encode(math.nan)))


def test_what_is_not_plain_data_is_refused_by_its_type():
    class Sneaky(int):
        def __eq__(self, other):
            return True

    for value, name in ((Sneaky(1), "Sneaky"), (object(), "object"), (bytearray(b"x"), "bytearray"),
                        ([1, {"k": range(3)}], "range")):
        with pytest.raises(NotPlain, match=f"^a {name} is not plain data"):
            encode(value)
    deep: list = []
    for _ in range(child.MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(NotPlain, match=f"plain data nested more than {child.MAX_DEPTH} deep"):
        encode(deep)
    assert isinstance(NotPlain("x"), TypeError)


@pytest.mark.parametrize("data,error,message", [
    (b"i1;i2;", ValueError, "3 bytes after the value"),
    (b"x", ValueError, r"unknown tag b'x' at byte 0"),
    (b"s9:abc", ValueError, "bad length 9 at byte 3"),
    (b"l9;i1;", ValueError, "bad length 9 at byte 3"),
    (b"l2;i1;", ValueError, "unknown tag b'' at byte 6"),
    (b"l1;" * (child.MAX_DEPTH + 2) + b"N", ValueError, f"nested more than {child.MAX_DEPTH} deep"),
    (b"i12", ValueError, "subsection not found"),  # no terminator
    (b"d1;l0;i1;", TypeError, "unhashable"),
])
def test_what_encode_did_not_make_is_an_error(data, error, message):
    with pytest.raises(error, match=message):
        decode(data)


def test_messages_cross_a_pipe_as_length_and_tuple(pipe):
    r, w = pipe.r, pipe.w
    child.send(w, ("call", "add", (1, 2), {"k": [b"x"]}))
    child.send(w, ("return", 3, []))
    assert child.receive(r) == ("call", "add", (1, 2), {"k": [b"x"]})
    assert child.receive(r) == ("return", 3, [])
    os.write(w, (3).to_bytes(4, "big") + b"i1;")
    with pytest.raises(ValueError, match="a message is a tuple that starts with its kind"):
        child.receive(r)
    os.write(w, (child.MAX_MESSAGE + 1).to_bytes(4, "big"))
    with pytest.raises(ValueError, match=f"a message of {child.MAX_MESSAGE + 1} bytes, more than {child.MAX_MESSAGE}"):
        child.receive(r)
    os.write(w, (10).to_bytes(4, "big") + b"t1;")  # cut short: the other end closes
    pipe.close(w)
    with pytest.raises(EOFError):
        child.receive(r)


def test_a_message_over_the_limit_is_not_sent(pipe):
    r, w = pipe.r, pipe.w
    with pytest.raises(NotPlain, match=r"a message of \d+ bytes, more than 16777216"):
        child.send(w, ("return", b"x" * child.MAX_MESSAGE, []))
    os.set_blocking(r, False)
    with pytest.raises(BlockingIOError):
        os.read(r, 1)  # nothing was written


def test_the_command_line_is_key_value_pairs():
    cfg = child.config(["status_fd=3", "mode=user", "guard=yes", "hide=no", "uid=none", "cpu_s=10", "nice=-5",
                        "folder=/tmp/box=1", "names=solve,,helper"])
    assert cfg == {"status_fd": 3, "mode": "user", "guard": True, "hide": False, "uid": None, "cpu_s": 10, "nice": -5,
                   "folder": "/tmp/box=1", "names": ["solve", "helper"]}
    assert child.config([])["names"] == [] and child.config(["names=none"])["names"] == []


def test_status_lines_are_json_with_the_event_and_pid(pipe):
    r, w = pipe.r, pipe.w
    child.report(w, "verdict", outcome="passed", detail='said "hi"\n', gone=None, ok=True, cpu_s=0.25, code=3,
                 path="caf\u00e9")
    line = os.read(r, 4096)
    assert line.endswith(b"\n") and line.count(b"\n") == 1 and line.isascii()
    assert json.loads(line) == {"event": "verdict", "pid": os.getpid(), "outcome": "passed", "detail": 'said "hi"\n',
                                "gone": None, "ok": True, "cpu_s": 0.25, "code": 3, "path": "caf\u00e9"}
    pipe.close(r)
    child.report(w, "exit", code=0)  # the host stopped reading (a broken pipe): no error


def test_mountinfo_paths_are_unescaped():
    assert child._unescape(r"/mnt/my\040disk\011tab\012line\134back") == "/mnt/my disk\ttab\nline\\back"


def test_refusals_are_permission_and_import_errors_with_their_category():
    e = Refused("process", "os.fork()")
    assert isinstance(e, PermissionError) and e.errno == errno.EPERM and e.category == "process"
    assert str(e) == "[Errno 1] sandbox refused os.fork() (process)"
    i = RefusedImport("network", "socket")
    assert isinstance(i, ImportError) and i.name == "socket" and i.category == "network"
    assert str(i) == "sandbox refused import of 'socket' (network)"


@pytest.mark.parametrize("exc,notes,expected", [
    (Refused("network", "socket.connect"), [], ("blocked", None, "network", "guard",
                                                "Refused: [Errno 1] sandbox refused socket.connect (network)")),
    (RefusedImport("native", "ctypes"), [], ("blocked", None, "native", "guard",
                                             "RefusedImport: sandbox refused import of 'ctypes' (native)")),
    (MemoryError(), [], ("killed", "memory", None, "kernel", "MemoryError")),
    (OSError(errno.EFBIG, "File too large"), [], ("killed", "file_size", None, "kernel",
                                                  "OSError: [Errno 27] File too large")),
    (OSError(errno.ENOSPC, "No space left"), [], ("killed", "disk", None, "kernel",
                                                  "OSError: [Errno 28] No space left")),
    (OSError(errno.EMFILE, "Too many"), [], ("killed", "open_files", None, "kernel", "OSError: [Errno 24] Too many")),
    (BlockingIOError(errno.EAGAIN, "again"), [], ("killed", "processes", None, "kernel",
                                                  "BlockingIOError: [Errno 11] again")),
    (TimeoutError(errno.EAGAIN, "timed out"), [], ("failed", None, None, "", "TimeoutError: [Errno 11] timed out")),
    (OSError(errno.ENETUNREACH, "Network is unreachable"), [], ("blocked", None, "network", "kernel",
                                                                "OSError: [Errno 101] Network is unreachable")),
    (PermissionError(errno.EACCES, "Permission denied", "/etc/shadow"), [],
     ("blocked", None, "filesystem", "kernel", "PermissionError: [Errno 13] Permission denied: '/etc/shadow'")),
    (PermissionError(errno.EPERM, "Operation not permitted"), [],
     ("blocked", None, "process", "kernel", "PermissionError: [Errno 1] Operation not permitted")),
    (FileNotFoundError(errno.ENOENT, "No such file", "/home/me/answers.json"), [],
     ("blocked", None, "filesystem", "kernel", "FileNotFoundError: [Errno 2] No such file: '/home/me/answers.json'")),
    (FileNotFoundError(errno.ENOENT, "No such file", "/box/data.txt"), [],
     ("failed", None, None, "", "FileNotFoundError: [Errno 2] No such file: '/box/data.txt'")),
    (ValueError("bad"), ["filesystem", "network"], ("blocked", None, "filesystem", "guard", "ValueError: bad")),
    (SystemExit(3), [], ("failed", None, None, "", "the program exited (SystemExit 3) before its tests finished")),
    (KeyError(), [], ("failed", None, None, "", "KeyError")),
])
def test_a_programs_exception_is_classified(exc, notes, expected):
    assert classify(exc, notes, "/box") == expected


def test_a_thread_that_cannot_start_is_a_process_limit_and_details_are_cut():
    assert classify(RuntimeError("can't start new thread"), []) == (
        "killed", "processes", None, "kernel", "RuntimeError: can't start new thread")  # 8 MiB more memory fits here
    outcome, _, _, _, detail = classify(ValueError("x" * 1000), [])
    assert outcome == "failed" and len(detail) == 500 and detail.startswith("ValueError: xxx")
