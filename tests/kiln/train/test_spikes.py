"""Tests of kiln/train/spikes.py: the spike detector's thresholds and state, and a loss spike in training rolls back,
skips the batches and recovers, or gives up after max_rollbacks or before the first checkpoint."""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path

import pytest

from kiln.train.spikes import SpikeConfig, SpikeDetector, SpikeError
from kiln.train.loop import main
from tests.conftest import LineReporter as ListReporter, single_thread as one_thread
from tests.faults import injector

POISON = [injector(spike_batch=17, spike_lr_factor=1000.0)]  # data batch 17 at 1000x the lr: wrecks the model


def spike_job(pretrain_job, path: Path, **spikes) -> Path:
    """30 steps at a steadier setting than the baseline (lr 3e-3, 8 sequences a step), checkpoints every 5 steps."""
    return pretrain_job(path, micro_batch=8, ckpt_interval=5, keep_last=3, optim={"lr": 3e-3, "warmup_steps": 5},
                        spikes={"warmup_steps": 5, "window": 20, "rollback_steps": 5, "skip_batches": 3, **spikes})


@pytest.mark.slow
def test_loss_spike_rolls_back_skips_the_batches_and_recovers(tmp_path, pretrain_job) -> None:
    """PaLM's recipe brings a run hit by a poisoned batch back to within a few percent of the clean run."""
    with one_thread():
        clean = main(["--config", str(spike_job(pretrain_job, tmp_path / "clean")), "--device", "cpu"],
                     reporter=ListReporter())
        broken = main(["--config", str(spike_job(pretrain_job, tmp_path / "off", enabled=False)), "--device", "cpu"],
                      reporter=ListReporter(), callbacks=POISON)
    assert clean["events"] == [] and broken["events"] == []
    assert broken["final_val_loss"] > 2 * clean["final_val_loss"], (broken["final_val_loss"], clean["final_val_loss"])

    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("spikes")).info.run_id
    job = spike_job(pretrain_job, tmp_path / "on")
    job.write_text(json.dumps({**json.loads(job.read_text()), "mlflow_tracking_uri": uri, "mlflow_run_id": run_id}))
    rep = ListReporter()
    with one_thread():
        res = main(["--config", str(job), "--device", "cpu"], reporter=rep, callbacks=POISON)
    [event] = res["events"]
    assert event["event"] == "rollback" and event["step"] == 19 and event["to_step"] == 10, event
    assert event["skipped_batches"] == 9  # batches 10..18 (the poisoned 17 among them) are never trained again
    assert res["steps"] == 30 and res["data_batches"] == 39
    assert abs(res["final_val_loss"] - clean["final_val_loss"]) / clean["final_val_loss"] < 0.03
    assert any("loss spike at step 19" in w and "Rolled back to step 10" in w for w in rep.warnings)
    spikes = client.get_metric_history(run_id, "spike")
    assert [(m.step, m.value) for m in spikes] == [(19, 1.0)]
    assert client.get_metric_history(run_id, "system/kiln.goodput")[0].value == pytest.approx(res["goodput"]["goodput"])
    assert res["goodput"]["redone_steps_s"] > 0  # steps 11..18 were trained twice


def test_spikes_give_up_after_max_rollbacks(tmp_path, pretrain_job) -> None:
    job = spike_job(pretrain_job, tmp_path, max_rollbacks=0)
    with pytest.raises(SpikeError, match=r"loss spike at step 19 .* after 0 rollbacks \(spikes\.max_rollbacks=0\)"):
        main(["--config", str(job), "--device", "cpu"], reporter=ListReporter(), callbacks=POISON)


def test_spikes_before_the_first_checkpoint_drop_updates_then_give_up(tmp_path, pretrain_job) -> None:
    job = spike_job(pretrain_job, tmp_path)
    job.write_text(json.dumps({**json.loads(job.read_text()), "ckpt_interval": 100}))  # nothing to roll back to
    rep = ListReporter()
    with pytest.raises(SpikeError, match=r"after 10 updates in a row were dropped, with no checkpoint yet"):
        main(["--config", str(job), "--device", "cpu"], reporter=rep, callbacks=POISON)
    dropped = [w for w in rep.warnings if "no checkpoint to roll back to, so this update is skipped" in w]
    assert len(dropped) == 10 and dropped[0].startswith("loss spike at step 19")


def test_spike_detector_thresholds_and_state() -> None:
    det = SpikeDetector(SpikeConfig(warmup_steps=2, window=10, loss_zscore=4, loss_rise=0.2, grad_ratio=5))
    for loss in (9.0, 6.0):  # warmup: the fast early fall is not a yardstick
        assert det.check(loss, 1.0) is None
    assert det.losses == deque([])
    for loss in (3.0, 2.9, 3.1, 3.0, 2.95):
        assert det.check(loss, 1.0) is None
    kind, why = det.check(6.0, 1.0)
    assert kind == "loss" and "std above its recent mean" in why and det.rolls_back((kind, why))
    assert det.check(3.2, 1.0) is None  # a bump, not a spike
    kind, why = det.check(3.0, 9.0)
    assert kind == "grad" and "gradient norm 9 is 9.0x its recent median" in why and not det.rolls_back((kind, why))
    assert det.rolls_back(det.check(float("nan"), 1.0))
    saved = det.state_dict()
    twin = SpikeDetector(det.cfg)
    twin.load_state_dict(json.loads(json.dumps(saved)))
    assert twin.check(6.0, 1.0) == det.check(6.0, 1.0) and twin.state_dict() == det.state_dict()
    strict = SpikeDetector(SpikeConfig(warmup_steps=0, rollback_on_grad=True, grad_ratio=5))
    for _ in range(5):
        strict.check(3.0, 1.0)
    assert strict.rolls_back(strict.check(3.0, 9.0))
    assert all(SpikeDetector(SpikeConfig()).check(x, 1.0) is None for x in (5.0, 50.0, 500.0))  # no baseline yet
