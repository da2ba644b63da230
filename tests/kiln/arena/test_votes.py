"""The arena's vote log: whole lines under concurrent appends (threads and processes), read back as written, and
damaged lines reported by file and line.

Run: python -m pytest tests/kiln/arena/test_votes.py -q
"""

from __future__ import annotations

import json
import multiprocessing
import threading

import pytest

from kiln.arena.votes import VoteLog, append_line, read_lines, score_of_left


def vote(i: int, choice: str = "left") -> dict:
    return {"round": f"r{i}", "time": "2026-12-01T00:00:00Z", "prompt": f"prompt {i} " + "x" * 3000,
            "left": {"name": "A", "weights": "aaaa", "path": "/m/a"}, "right": {"name": "B", "weights": "bbbb", "path": "/m/b"},
            "vote": choice, "winner": "A"}


def _append_many(path: str, start: int) -> None:
    log = VoteLog(path)
    for i in range(start, start + 40):
        log.append(vote(i))


def test_concurrent_appends_from_threads_and_processes_leave_whole_lines(tmp_path):
    path = tmp_path / "arena" / "id" / "votes.jsonl"  # the folders are made on the first append
    log = VoteLog(path)
    threads = [threading.Thread(target=lambda k=k: [log.append(vote(k * 100 + i)) for i in range(40)]) for k in range(3)]
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(str(path), 1000 + k * 100)) for k in range(2)]
    for t in (*procs, *threads):  # fork before any thread runs: a child forked mid-append could inherit a held lock
        t.start()
    for t in (*threads, *procs):
        t.join()
    assert all(p.exitcode == 0 for p in procs)
    lines = path.read_text().splitlines()
    assert len(lines) == 200 and all(json.loads(line)["vote"] == "left" for line in lines)  # 3.1 kB lines, none torn
    rounds = {v["round"] for v in log.read()}
    assert len(rounds) == 200 and {"r0", "r239", "r1000", "r1139"} <= rounds


def test_votes_read_back_as_written_in_order(tmp_path):
    log = VoteLog(tmp_path / "votes.jsonl")
    assert log.read() == []  # no file yet: no votes
    written = [vote(0, "left"), vote(1, "tie"), vote(2, "both_bad"), vote(3, "right")]
    for v in written:
        log.append(v)
    again = VoteLog(tmp_path / "votes.jsonl").read()
    assert again == written
    assert [score_of_left(v["vote"]) for v in again] == [1.0, 0.5, 0.5, 0.0]


def test_damaged_lines_name_the_file_and_line(tmp_path):
    path = tmp_path / "votes.jsonl"
    log = VoteLog(path)
    log.append(vote(0))
    log.append(vote(1))
    with open(path, "a") as f:
        f.write('{"round": "r2", "vote": "le')  # a line cut short
    with pytest.raises(ValueError, match=rf"{path}:3: not valid JSON .*repair or delete that line"):
        log.read()
    path.write_text(json.dumps(vote(0)) + "\n\n" + json.dumps({**vote(1), "vote": "maybe"}) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:3: vote 'maybe' is not one of \['left', 'right', 'tie', 'both_bad'\]"):
        log.read()
    bad = vote(1)
    del bad["prompt"]
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:1: vote lacks \['prompt'\]"):
        log.read()
    path.write_text(json.dumps({**vote(1), "right": {"name": "B"}}) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:1: 'right' must hold \['name', 'weights'\]"):
        log.read()
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=rf"{path}:1: a record must be a JSON object, got list"):
        read_lines(path)
    with pytest.raises(ValueError, match="vote 'maybe' is not one of"):  # a bad vote never reaches the file
        log.append({**vote(1), "vote": "maybe"})
    append_line(tmp_path / "answers.jsonl", {"prompt": "p", "answer": "ü"})
    assert read_lines(tmp_path / "answers.jsonl") == [(1, {"prompt": "p", "answer": "ü"})]
