"""Tests for preemption (kiln.train.preempt) and the run logbook (kiln.train.logbook) on one CPU process: SIGTERM
mid-run saves the step reached and exits PREEMPTED_EXIT, the next launch resumes bit-identically; a run that is
preempted, crashes and rolls back has each attempt in its logbook.

Run: python -m pytest tests/kiln/train/test_preempt.py -q   (subprocess runs are marked slow)
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from kiln.train import logbook
from kiln.train.checkpoint import list_checkpoints, step_of
from kiln.train.preempt import PREEMPTED_EXIT, PreemptionWatch, exit_code
from tests.kiln.train.test_trainer import assert_same_final_state, popen_train, result_of, run_dir


def test_the_watch_sets_a_flag_and_restores_the_handlers() -> None:
    before = signal.getsignal(signal.SIGTERM)
    watch = PreemptionWatch()
    assert watch.install() and not watch.requested
    signal.raise_signal(signal.SIGUSR1)  # Slurm's --signal=USR1@N
    assert watch.requested and watch.signal_name == "SIGUSR1" and watch.seconds_since() >= 0
    watch.restore()
    assert signal.getsignal(signal.SIGTERM) == before
    assert exit_code({"outcome": "preempted"}) == PREEMPTED_EXIT == 75 and exit_code({"outcome": "completed"}) == 0


@pytest.mark.slow
def test_sigterm_mid_run_saves_the_step_reached_and_resume_is_bit_identical(tmp_path, baseline, pretrain_job,
                                                                           train_runner) -> None:
    ref_job, _ = baseline
    job = pretrain_job(tmp_path, log_interval=1)
    proc = popen_train(job)
    lines = []
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line)
        if line.startswith("step 13/30"):  # between checkpoints (10, 20): a SIGKILL here would lose 3 steps
            proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == PREEMPTED_EXIT, "".join(lines)
    reached = max(int(m.group(1)) for ln in lines if (m := re.match(r"step (\d+)/30", ln)))
    res = result_of(job)
    assert res["outcome"] == "preempted" and res["steps"] == reached >= 13
    assert res["preemption"]["saved_step"] == reached and res["preemption"]["signal"] == "SIGTERM"
    assert res["preemption"]["within_grace"] is True
    run = run_dir(job)
    assert step_of(list_checkpoints(run / "checkpoints")[-1]) == reached  # nothing since the last step is lost
    resumed = train_runner(job)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    res = result_of(job)
    assert res["outcome"] == "completed" and Path(res["resumed_from"]).name == f"step_{reached:07d}"
    assert_same_final_state(ref_job, job)
    rows = logbook.attempts(run)
    assert [(r["attempt"], r["outcome"], r["to_step"], r["steps_lost"]) for r in rows] == [
        ("1.0", "preempted", reached, 0), ("2.0", "completed", 30, 0)]
    assert rows[0]["note"] == "SIGTERM" and rows[1]["from_step"] == reached
