"""Tests of kiln/train/telemetry.py: a training run records MLflow system metrics, and a run shorter than one sampling
interval still has a system sample."""

from __future__ import annotations

import json


def test_a_training_run_records_mlflow_system_metrics(tmp_path, pretrain_job) -> None:
    from mlflow.tracking import MlflowClient

    from kiln.train.loop import main
    from tests.faults import injector
    from tests.kiln.train.test_trainer import ListReporter

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("system")).info.run_id
    job = pretrain_job(tmp_path, max_steps=8, mlflow_tracking_uri=uri, mlflow_run_id=run_id, system_metrics_s=0.5)
    main(["--config", str(job), "--device", "cpu"], reporter=ListReporter(), callbacks=[injector(step_sleep_s=0.3)])
    keys = set(client.get_run(run_id).data.metrics)
    for key in ("system/cpu_utilization_percentage", "system/system_memory_usage_megabytes",
                "system/system_memory_usage_percentage"):
        assert key in keys, sorted(keys)
    history = client.get_metric_history(run_id, "system/system_memory_usage_megabytes")
    assert len(history) >= 2 and all(m.value > 0 for m in history)
    assert [m.step for m in history] == list(range(len(history)))  # MLflow's own sample count
    # a second attempt in the same MLflow run (a torchrun restart; here with a longer run) keeps the first values of
    # its params (MLflow refuses changed ones) and continues the sample count
    job.write_text(json.dumps({**json.loads(job.read_text()), "max_steps": 12}))
    main(["--config", str(job), "--device", "cpu"], reporter=ListReporter(), callbacks=[injector(step_sleep_s=0.3)])
    assert client.get_run(run_id).data.params["job.max_steps"] == "8"
    again = client.get_metric_history(run_id, "system/system_memory_usage_megabytes")
    assert [m.step for m in again] == list(range(len(again))) and len(again) > len(history)


def test_a_run_shorter_than_one_sampling_interval_still_has_a_system_sample(tmp_path) -> None:
    import types

    import torch
    from mlflow.tracking import MlflowClient

    from kiln.train.dist import DistInfo
    from kiln.train.telemetry import SystemMetrics

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("short")).info.run_id
    job = types.SimpleNamespace(mlflow_tracking_uri=uri, mlflow_run_id=run_id, system_metrics_s=30.0)
    SystemMetrics(job, DistInfo(0, 0, 1, torch.device("cpu"))).stop()  # stopped long before the first interval ends
    [sample] = client.get_metric_history(run_id, "system/system_memory_usage_megabytes")
    assert sample.step == 0 and sample.value > 0
    off = SystemMetrics(types.SimpleNamespace(**{**vars(job), "system_metrics_s": 0.0}), DistInfo(0, 0, 1, torch.device("cpu")))
    assert off.monitor is None


def test_the_cpu_peak_for_mfu_is_measured_in_the_precision_the_run_multiplies_in(monkeypatch) -> None:
    import torch

    import kiln.plan.memory as memory
    from kiln.train.telemetry import resolve_peak_flops

    asked = []
    monkeypatch.setattr(memory, "measure_matmul_peak", lambda device, dtype=None: asked.append((device, dtype)) or 1e11)
    cpu = torch.device("cpu")
    assert resolve_peak_flops(0.0, cpu) == 1e11 and resolve_peak_flops(0.0, cpu, cpu_bf16=True) == 1e11
    assert asked == [("cpu", None), ("cpu", torch.bfloat16)]  # fp32's peak, then bf16's under autocast
    assert resolve_peak_flops(5e12, cpu, cpu_bf16=True) == 5e12 and resolve_peak_flops(-1.0, cpu) == 0.0  # the job's
    assert len(asked) == 2
