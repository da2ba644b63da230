"""Tests for kiln.train.goodput: the records GoodputClock writes (session start, ready, cumulative beats whose lineage
time counts only steps and resets on a rollback) and summarize's split of a run's wall time across a crash and a
restart into productive and redone steps, saving, validation, start-up, restarting and the rest, to the second.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kiln.train import goodput
from kiln.train.goodput import GoodputClock, summarize
from kiln.train.journal import JOURNAL, Journal, read

ROOT = Path(__file__).resolve().parents[3]


def write_journal(run_dir, records: list[dict]) -> None:
    (run_dir / JOURNAL).write_text("".join(json.dumps(r) + "\n" for r in records))


def beat(session: str, t: float, step: int, lineage_s: float, step_s: float, save_s: float = 0.0, eval_s: float = 0.0,
         restore_s: float = 0.0) -> dict:
    return {"event": "beat", "session": session, "t": t, "step": step, "lineage_s": lineage_s, "step_s": step_s,
            "save_s": save_s, "eval_s": eval_s, "restore_s": restore_s}


# Session a: starts at 100, ready at 110, steps to 12 by 160, then dies. Session b: starts at 170, restores step 10
# (whose weights took 30 s of steps) and is ready at 180, then steps to 14 by 200.
CRASHED_RUN = [
    {"event": "session", "session": "a", "t": 100.0},
    {"event": "start", "session": "a", "t": 100.5, "attempt": "1.0"},  # the logbook's: not goodput's
    {"event": "ready", "session": "a", "t": 110.0, "step": 0, "lineage_s": 0.0},
    beat("a", 150.0, 10, 30.0, 30.0, save_s=5.0, eval_s=2.0),
    beat("a", 160.0, 12, 36.0, 36.0, save_s=6.0, eval_s=3.0),
    {"event": "session", "session": "b", "t": 170.0},
    {"event": "ready", "session": "b", "t": 180.0, "step": 10, "lineage_s": 30.0},
    beat("b", 200.0, 14, 42.0, 12.0, save_s=1.0, restore_s=0.5),
    {"event": "end", "session": "b", "t": 200.0, "outcome": "completed"},
]


def test_a_crashed_and_resumed_run_is_split_into_where_its_time_went(tmp_path):
    write_journal(tmp_path, CRASHED_RUN)
    assert summarize(tmp_path) == {
        "goodput": pytest.approx(42.0 / 100.0), "wall_s": 100.0, "sessions": 2,
        "productive_s": 42.0,  # the steps that made the final weights
        "redone_steps_s": 6.0,  # 48 s of steps in all; steps 11 and 12 of session a were lost in the crash
        "saving_s": 7.0, "validation_s": 3.0, "startup_s": 10.0,
        "restarting_s": 20.5,  # 160 -> 180: dead time and the second start-up; then 0.5 s restoring
        "other_s": 11.5,  # 100 s less all the above
    }


def test_sessions_are_ordered_by_start_and_one_that_never_got_ready_is_all_restart(tmp_path):
    records = [
        {"event": "session", "session": "late", "t": 300.0},
        beat("late", 340.0, 5, 25.0, 25.0),
        {"event": "session", "session": "first", "t": 200.0},
        {"event": "ready", "session": "first", "t": 204.0, "step": 0, "lineage_s": 0.0},
        beat("first", 250.0, 5, 25.0, 25.0),
        {"event": "session", "session": "dead", "t": 260.0},  # killed while starting: no ready, no beat
    ]
    write_journal(tmp_path, records)
    got = summarize(tmp_path)
    assert (got["sessions"], got["wall_s"], got["startup_s"]) == (3, 140.0, 4.0)
    # "dead" ends where it began (260: 10 s after 250); "late" has no ready either: its restart runs to its last beat
    assert got["restarting_s"] == 10.0 + 80.0
    assert got["productive_s"] == 25.0 and got["redone_steps_s"] == 25.0
    assert got["goodput"] == pytest.approx(25.0 / 140.0)


def test_a_run_without_session_records_has_no_summary(tmp_path):
    assert summarize(tmp_path) == {}
    write_journal(tmp_path, [{"event": "start", "session": "a", "t": 1.0}, {"event": "end", "session": "a", "t": 2.0}])
    assert summarize(tmp_path) == {}
    write_journal(tmp_path, [{"event": "session", "session": "a", "t": 5.0}])
    assert summarize(tmp_path) == {"goodput": 0.0, "wall_s": 0.0, "sessions": 1, "productive_s": 0.0,
                                   "redone_steps_s": 0.0, "saving_s": 0.0, "validation_s": 0.0, "startup_s": 0.0,
                                   "restarting_s": 0.0, "other_s": 0.0}


def test_the_clock_writes_cumulative_beats_and_a_rollback_resets_the_lineage(tmp_path, monkeypatch):
    now = iter([110.0, 120.0, 130.0, 140.0])
    monkeypatch.setattr(goodput, "process_start_time", lambda: 100.0)
    monkeypatch.setattr(goodput, "time", SimpleNamespace(time=lambda: next(now)))
    clock = GoodputClock(Journal(tmp_path, True))
    clock.ready(4, 8.0)  # resumed from a checkpoint of step 4 made by 8 s of steps
    clock.add("step_s", 2.0)
    clock.add("save_s", 1.0)
    clock.add("eval_s", 0.5)
    clock.beat(5)
    clock.add("step_s", 3.0)
    clock.restored(4, 8.0)  # a loss spike: back to step 4's weights
    clock.add("restore_s", 0.25)
    clock.add("step_s", 2.0)
    clock.beat(5)
    records = read(tmp_path)
    assert len({r.pop("session") for r in records}) == 1
    assert records == [
        {"event": "session", "t": 100.0},
        {"event": "ready", "t": 110.0, "step": 4, "lineage_s": 8.0},
        {"event": "beat", "t": 120.0, "step": 5, "lineage_s": 10.0, "step_s": 2.0, "save_s": 1.0, "eval_s": 0.5,
         "restore_s": 0.0},
        {"event": "beat", "t": 130.0, "step": 5, "lineage_s": 10.0, "step_s": 7.0, "save_s": 1.0, "eval_s": 0.5,
         "restore_s": 0.25},
    ]
    assert (clock.step, clock.lineage_s) == (5, 10.0)
    got = summarize(tmp_path)
    assert (got["productive_s"], got["redone_steps_s"], got["startup_s"], got["wall_s"]) == (10.0, 0.0, 10.0, 30.0)


def test_the_clock_falls_back_to_now_where_the_process_start_is_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(goodput, "process_start_time", lambda: None)
    monkeypatch.setattr(goodput, "time", SimpleNamespace(time=lambda: 123.0))
    GoodputClock(Journal(tmp_path, True))
    assert [(r["event"], r["t"]) for r in read(tmp_path)] == [("session", 123.0)]


def test_the_command_line_prints_the_summary_as_json(tmp_path):
    write_journal(tmp_path, CRASHED_RUN)
    out = subprocess.run([sys.executable, "-m", "kiln.train.goodput", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == summarize(tmp_path)
