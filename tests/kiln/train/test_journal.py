"""Tests for the run journal (kiln.train.journal): one file per run folder that both the goodput clock
(kiln.train.goodput) and the logbook (kiln.train.logbook) write and read, a killed attempt's last step read from its
process's last beat, and nothing written on ranks other than 0.

Run: python -m pytest tests/kiln/train/test_journal.py -q
"""

from __future__ import annotations

import pytest

from kiln.train.goodput import GoodputClock, summarize
from kiln.train.journal import JOURNAL, Journal, read
from kiln.train.logbook import Logbook, attempts


def process(run, launch: str, monkeypatch) -> tuple[GoodputClock, Logbook]:
    """What a training process opens on rank 0: one journal, its clock and its logbook."""
    monkeypatch.setenv("KILN_LAUNCH_ID", launch)
    journal = Journal(run, True)
    return GoodputClock(journal), Logbook(journal)


def test_one_journal_holds_the_time_and_the_attempts_of_a_run(tmp_path, monkeypatch) -> None:
    clock, book = process(tmp_path, "a", monkeypatch)
    book.begin(0, "fresh", {"max_steps": 3}, {"world_size": 1})
    clock.ready(0, 0.0)
    for step in (1, 2, 3):
        clock.add("step_s", 0.5)
        clock.beat(step)  # then SIGKILL: this attempt has no end record
    clock, book = process(tmp_path, "b", monkeypatch)
    book.begin(2, "resume", {"max_steps": 3}, {"world_size": 1})
    clock.ready(2, 1.0)  # the checkpoint of step 2 carries the time of the steps that made it
    clock.add("step_s", 0.5)
    clock.beat(3)
    book.end("completed", 3)

    assert [p.name for p in tmp_path.iterdir()] == [JOURNAL]
    records = read(tmp_path)
    assert len({r["session"] for r in records}) == 2 and [r["event"] for r in records][:3] == ["session", "start", "ready"]
    rows = attempts(tmp_path)
    assert [(r["attempt"], r["outcome"], r["from_step"], r["to_step"], r["steps_lost"]) for r in rows] == [
        ("1.0", "killed", 0, 3, 1), ("2.0", "completed", 2, 3, 0)]
    good = summarize(tmp_path)
    assert good["sessions"] == 2
    assert good["productive_s"] == pytest.approx(1.5) and good["redone_steps_s"] == pytest.approx(0.5)


def test_other_ranks_write_nothing(tmp_path) -> None:
    journal = Journal(tmp_path, False)
    clock, book = GoodputClock(journal), Logbook(journal)
    assert book.begin(0, "fresh", {}, {}) == ""
    clock.ready(0, 0.0)
    clock.beat(1)
    book.end("completed", 1)
    assert list(tmp_path.iterdir()) == [] and attempts(tmp_path) == [] and summarize(tmp_path) == {}
