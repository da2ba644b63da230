"""Tests of kiln/train/loop.py (python -m kiln.train's main): an unknown job key exits non-zero naming it, and an unknown
nested key is named."""

from __future__ import annotations

import json

import pytest

from kiln.common.config import ConfigError
from kiln.train.loop import main


@pytest.mark.slow
def test_unknown_job_key_exits_non_zero_naming_it(tmp_path, pretrain_job, train_runner) -> None:
    job = pretrain_job(tmp_path, learning_rate=0.1)
    proc = train_runner(job)
    assert proc.returncode != 0
    assert "job: unknown key 'learning_rate'" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "section,key,message",
    [
        ("model", "n_layers", r"job\.model: unknown key 'n_layers'\. Did you mean 'n_layer'\?"),
        ("optim", "warmup", r"job\.optim: unknown key 'warmup'\. Did you mean 'warmup_steps'\?"),
        ("spikes", "rollback_step", r"job\.spikes: unknown key 'rollback_step'\. Did you mean 'rollback_steps'\?"),
    ],
    ids=["model", "optim", "spikes"],
)
def test_unknown_nested_key_is_named(tmp_path, pretrain_job, section, key, message) -> None:
    path = pretrain_job(tmp_path)
    job = json.loads(path.read_text())
    job.setdefault(section, {})[key] = 1
    path.write_text(json.dumps(job))
    with pytest.raises(ConfigError, match=message):
        main(["--config", str(path), "--device", "cpu"])
    assert not (tmp_path / "run").exists()  # rejected before anything is written
