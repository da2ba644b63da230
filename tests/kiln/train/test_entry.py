"""Tests for kiln.train.entry: the job file's task picks the module whose main runs it (pretrain when unsaid), an
unknown task is an error naming the file, main hands the command line, reporter and callbacks to that module, and
run_job reads the command line before anything else and trains a tiny job to its last step.
"""

from __future__ import annotations

import json

import pytest

from kiln.train import entry, loop
from kiln.train.entry import TASKS, entry_point, main, run_job
from kiln.train.job import JobConfig
from tests.conftest import LineReporter, single_thread


def job_file(tmp_path, **fields):
    path = tmp_path / "job.json"
    path.write_text(json.dumps(fields))
    return path


def test_each_task_is_run_by_its_modules_main(tmp_path):
    got = {task: entry_point(["--config", str(job_file(tmp_path, task=task))]) for task in TASKS}
    assert {task: (fn.__module__, fn.__name__) for task, fn in got.items()} == {
        "pretrain": ("kiln.train.loop", "main"), "sft": ("kiln.train.loop", "main"),
        "dpo": ("kiln.posttrain.dpo", "main"), "rl": ("kiln.posttrain.rl", "main"),
        "reward": ("kiln.posttrain.reward", "main"), "ppo": ("kiln.posttrain.ppo", "main")}


def test_a_job_without_a_task_or_a_command_line_without_a_config_is_pretraining(tmp_path):
    assert entry_point(["--config", str(job_file(tmp_path, max_steps=3)), "--device", "cpu"]) is loop.main
    assert entry_point(["--device", "cpu"]) is loop.main  # run_job's parser then asks for --config


def test_an_unknown_task_names_the_file_and_the_known_tasks(tmp_path):
    path = job_file(tmp_path, task="kto")
    with pytest.raises(ValueError) as e:
        entry_point(["--device", "cpu", "--config", str(path)])
    assert str(e.value) == f"{path}: task 'kto' is not one of pretrain, sft, dpo, rl, reward, ppo"


def test_main_hands_the_command_line_reporter_and_callbacks_to_the_tasks_main(tmp_path, monkeypatch):
    calls = []

    def fake_main(argv, reporter, callbacks):
        calls.append((argv, reporter, callbacks))
        return {"steps": 7}

    monkeypatch.setattr(loop, "main", fake_main)
    argv = ["--config", str(job_file(tmp_path, task="sft")), "--device", "cpu"]
    reporter, callbacks = LineReporter(), (object(),)
    assert main(argv, reporter, callbacks) == {"steps": 7}
    assert calls == [(argv, reporter, callbacks)]
    monkeypatch.setattr(entry.sys, "argv", ["kiln.train", "--config", argv[1]])
    assert main() == {"steps": 7} and calls[-1] == (["--config", argv[1]], None, ())  # sys.argv without the program


def test_run_job_reads_the_command_line_before_joining_a_process_group(capsys, monkeypatch):
    from kiln.train import dist

    monkeypatch.setattr(dist, "setup_distributed", lambda *a: pytest.fail("the process group was joined"))
    with pytest.raises(SystemExit) as e:
        run_job(JobConfig, lambda job, info: None, "A job.", ["--device", "cpu"])
    assert e.value.code == 2 and "the following arguments are required: --config" in capsys.readouterr().err


def test_main_trains_a_tiny_pretraining_job_to_its_last_step(tmp_path, pretrain_job):
    job = pretrain_job(tmp_path, max_steps=2, eval_interval=2, ckpt_interval=2, log_interval=1, eval_batches=1)
    reporter = LineReporter()
    with single_thread():
        result = main(["--config", str(job), "--device", "cpu"], reporter=reporter)
    assert (result["task"], result["steps"], result["outcome"], result["world_size"]) == ("pretrain", 2, "completed", 1)
    assert result["tokens"] == 2 * 4 * 32  # steps x micro_batch x seq_len
    assert [c["step"] for c in result["checkpoints"]] == [2]
    assert json.loads((tmp_path / "run" / "result.json").read_text())["steps"] == 2
    assert reporter.lines[-1].startswith("step 2/2: loss ")
