"""Tests of kiln/train/logbook.py: attempt ids climb and config changes are listed, and a logbook holds a preemption, a
crash and a rollback."""

from __future__ import annotations

import json

import pytest

from kiln.train import logbook
from kiln.train.journal import Journal
from kiln.train.loop import main
from tests.faults import injector
from tests.kiln.train.test_spikes import spike_job
from tests.kiln.train.test_trainer import ListReporter, one_thread, run_dir


def test_attempt_ids_climb_and_config_changes_are_listed(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KILN_LAUNCH_ID", "launch-a")
    book = logbook.Logbook(Journal(tmp_path, True))
    assert book.begin(0, "fresh", {"max_steps": 10, "out_dir": "/x"}, {"world_size": 1}) == "1.0"
    book.end("crashed", 4, error="RuntimeError: boom")
    assert book.begin(3, "resume", {"max_steps": 10}, {"world_size": 1}) == "1.1"  # a torchrun restart
    book.event("skipped_update", 5, reason="loss")
    book.end("rolled_back", 7, to_step=5, skipped_batches=3, reason="loss 9.0 is 8 std above")
    assert book.begin(5, "rollback", {"max_steps": 10}, {"world_size": 1}) == "1.2"
    monkeypatch.setenv("KILN_LAUNCH_ID", "launch-b")
    assert book.begin(6, "resume", {"max_steps": 20}, {"world_size": 2}) == "2.0"  # killed before: no end line
    book.end("completed", 20)
    rows = logbook.attempts(tmp_path)
    assert [(r["attempt"], r["outcome"], r["from_step"], r["to_step"], r["steps_lost"]) for r in rows] == [
        ("1.0", "crashed", 0, 4, 1), ("1.1", "rolled_back", 3, 7, 2), ("1.2", "killed", 5, 5, 0),
        ("2.0", "completed", 6, 20, 0)]
    assert rows[1]["skipped_batches"] == 3 and rows[1]["spikes"] == 2
    assert rows[3]["config_changes"] == "max_steps: 10 -> 20, world_size: 1 -> 2"
    assert logbook.summary(rows)["attempts"] == 4 and logbook.summary(rows)["killed"] == 1
    assert "| 1.1 |" in logbook.format_table(rows) and "rolled_back" in logbook.format_table(rows)
    with pytest.raises(ValueError, match="not one of completed"):
        book.end("exploded", 1)


@pytest.mark.slow
def test_a_logbook_holds_a_preemption_a_crash_and_a_rollback(tmp_path, pretrain_job) -> None:
    """Three launches of one run: SIGTERM at step 4, a crash at step 12, then a loss spike at step 19 that rolls
    back to step 10 and trains to the end; the logbook has one row per attempt and the ledger their device-hours."""
    from kiln.plan.cost import CostConfig
    from kiln.train.energy import run_ledger

    job = spike_job(pretrain_job, tmp_path)
    argv = ["--config", str(job), "--device", "cpu"]
    faults = [injector(term_at_step=4, fail_at_step=12, spike_batch=17, spike_lr_factor=1000.0)]
    with one_thread():
        assert main(argv, reporter=ListReporter(), callbacks=faults)["outcome"] == "preempted"
        with pytest.raises(RuntimeError, match="injected failure at step 12"):
            main(argv, reporter=ListReporter(), callbacks=faults)
        assert main(argv, reporter=ListReporter(), callbacks=faults)["outcome"] == "completed"
    rows = logbook.attempts(run_dir(job))
    got = [(r["attempt"], r["outcome"], r["from_step"], r["to_step"], r["steps_lost"]) for r in rows]
    assert got == [("1.0", "preempted", 0, 4, 0), ("2.0", "crashed", 4, 12, 2), ("3.0", "rolled_back", 10, 18, 8),
                   ("3.1", "completed", 10, 30, 0)], got
    assert rows[1]["note"].startswith("RuntimeError: injected failure") and rows[2]["skipped_batches"] == 9
    assert "back to step 10" in rows[2]["note"] and rows[3]["how"] == "rollback"
    print("\n" + logbook.format_table(rows))
    ledger = run_ledger(rows, {"est_hours": 0.001, "world_size": 1}, CostConfig(2.0, "USD", 10.0))
    hours = sum(r["hours"] for r in rows)
    assert ledger["device_hours"] == pytest.approx(hours, rel=1e-3) and ledger["energy_estimated"] is True
    assert ledger["energy_kwh"] == pytest.approx(hours * 10 / 1000, rel=1e-3, abs=6e-7)  # the ledger keeps 6 decimals
    assert ledger["cost"] == pytest.approx(hours * 2.0, abs=1e-4) and ledger["planned_device_hours"] == 0.001
    assert json.loads(json.dumps(ledger)) == ledger
