"""Tests for the cost and energy figures: the planner's planned costs and compute-optimal size (kiln.plan), the run
ledger with NVML energy counters or the configured watts (kiln.train.energy), the model card's operations section
(kiln.release.card), ``kiln logbook`` on a release, and MLflow's system metrics from a training run.

Run: python -m pytest tests/kiln/train/test_energy.py -q
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from kiln.model.config import ModelConfig, preset_fields
from kiln.plan.cost import CostConfig, compute_optimal, describe_costs, load_cost, planned_costs
from kiln.plan.memory import BatchConfig, HardwareConfig, PlanError, make_plan
from kiln.train import logbook
from kiln.train.energy import EnergyMeter, ledger_table, run_ledger
from kiln.train.journal import Journal


def gpt2_plan(nproc: int = 8):
    fields = {**preset_fields("gpt2"), "vocab_size": 50304}
    return make_plan(ModelConfig(**fields), BatchConfig(1024, 512, None, 19073), HardwareConfig("cuda", nproc, 1, 80))


def test_compute_optimal_is_twenty_tokens_per_parameter_at_the_same_budget() -> None:
    opt = compute_optimal(124_000_000, 10_000_000_000)
    assert opt["budget_flops"] == pytest.approx(6 * 124e6 * 10e9)
    assert opt["optimal_tokens"] == pytest.approx(20 * opt["optimal_params"], rel=1e-6)
    assert 6 * opt["optimal_params"] * opt["optimal_tokens"] == pytest.approx(opt["budget_flops"], rel=1e-6)
    assert opt["params_ratio"] == pytest.approx(124e6 / 248.998e6, rel=1e-3) and opt["tokens_ratio"] == pytest.approx(
        1 / opt["params_ratio"], rel=1e-6)
    at = compute_optimal(1_000_000, 20_000_000)
    assert at["params_ratio"] == pytest.approx(1.0) and at["tokens_per_param"] == 20


def test_planned_costs_and_the_plan_lines_for_gpt2_on_8_gpus() -> None:
    plan = gpt2_plan()
    cost = CostConfig(price_per_device_hour=2.5, currency="USD", watts_per_device=700)
    got = planned_costs(plan, cost)
    assert got["device_hours"] == pytest.approx(plan.est_hours * 8, rel=1e-6)
    assert got["cost"] == pytest.approx(got["device_hours"] * 2.5, abs=1e-3)
    assert got["energy_kwh"] == pytest.approx(got["device_hours"] * 0.7, rel=1e-6)
    text = describe_costs(plan, cost)
    assert "6 device-hours (0.75 h x 8) at 2.5 USD/device-hour: 15.00 USD" in text
    assert "energy about 4.2 kWh (estimate: 700 W per device)" in text
    assert "249.5M parameters" in text and "below it: 0.50x the size on 2.00x the tokens" in text


def test_cost_settings_come_from_conf_and_unknown_keys_are_errors(tmp_path) -> None:
    assert load_cost("cuda") == CostConfig(2.5, "USD", 700.0)
    assert load_cost("cpu").watts_per_device == 15.0
    bad = tmp_path / "cost.yaml"
    bad.write_text("cuda: {price_per_gpu_hour: 3}\n")
    with pytest.raises(Exception, match="price_per_gpu_hour"):
        load_cost("cuda", str(bad))
    with pytest.raises(PlanError, match="no block for device 'cpu'"):
        load_cost("cpu", str(bad))


def rows(energy_j=None):
    return [{"hours": 0.5, "world_size": 8, "energy_j": energy_j, "outcome": "preempted"},
            {"hours": 1.0, "world_size": 8, "energy_j": energy_j, "outcome": "completed"}]


def test_the_ledger_estimates_energy_without_counters_and_uses_them_when_read() -> None:
    cost = CostConfig(2.0, "EUR", 500.0)
    est = run_ledger(rows(), {"est_hours": 1.0, "world_size": 8}, cost)
    assert est["device_hours"] == 12.0 and est["cost"] == 24.0 and est["currency"] == "EUR"
    assert est["energy_kwh"] == 6.0 and est["energy_estimated"] and est["energy_basis"].startswith("estimate (500 W")
    assert est["planned_device_hours"] == 8.0 and est["planned_cost"] == 16.0 and est["planned_energy_kwh"] == 4.0
    measured = run_ledger(rows(energy_j=3.6e6), None, cost)  # 1 kWh each attempt
    assert measured["energy_kwh"] == 2.0 and not measured["energy_estimated"]
    assert measured["energy_basis"] == "measured (NVML energy counters)"
    assert [r["measure"] for r in ledger_table(est)] == ["device-hours", "energy (kWh)", "cost (EUR)"]


def test_the_energy_meter_reads_nvml_counters_of_the_visible_gpus(monkeypatch) -> None:
    counters = {0: 1_000_000, 3: 5_000_000}  # millijoules since the driver loaded

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 4,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetTotalEnergyConsumption=lambda h: counters[h])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,0")
    meter = EnergyMeter("cuda", local_devices=2)
    counters[3] += 2_000_000
    counters[0] += 500_000
    assert meter.joules() == pytest.approx(2500.0)
    assert EnergyMeter("cpu").joules() is None


def test_the_model_card_totals_the_chain_and_kiln_logbook_reads_a_release(tmp_path, capsys) -> None:
    from kiln.release.card import _operations, logbook_summary

    up = {}
    for i, (asset, outcome) in enumerate([("base_model", "preempted"), ("sft_model", "completed"),
                                          ("dpo_model", "completed"), ("rl_model", "completed")]):
        run = tmp_path / asset / "run"
        book = logbook.Logbook(Journal(run, True))
        book.begin(0, "fresh", {"max_steps": 4}, {"world_size": 1})
        book.end(outcome, 2)
        if outcome == "preempted":
            book.begin(2, "resume", {"max_steps": 4}, {"world_size": 1})
            book.end("completed", 4)
        (run / "checkpoints" / "step_0000004").mkdir(parents=True)
        att = logbook.attempts(run)
        up[asset] = {"logbook": att, "checkpoint": str(run / "checkpoints" / "step_0000004"),
                     "ledger": run_ledger([{**r, "hours": 0.25} for r in att], {"est_hours": 0.5, "world_size": 1},
                                          CostConfig(4.0, "USD", 100.0))}
    summary = logbook_summary(up)
    assert [r["stage"] for r in summary] == ["base", "sft", "dpo", "rl"]
    assert summary[0]["attempts"] == 2 and summary[0]["ended"] == "1 completed, 1 preempted"
    section = _operations(up)
    assert section.startswith("## Training operations, cost and energy")
    assert "All the training runs above: 1.25 device-hours, 0.125 kWh (partly or wholly estimated), 5 USD." in section
    assert "The plan estimated 0.5 device-hours (0.05 kWh, 2 USD) for the base model." in section
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "kiln.json").write_text(json.dumps({
        "training": {"base_model": {"checkpoint": up["base_model"]["checkpoint"]}},
        "post_training": [{"stage": s, "checkpoint": up[a]["checkpoint"]}
                          for s, a in (("sft", "sft_model"), ("dpo", "dpo_model"), ("rl", "rl_model"))]}))
    from jobs.cli import main

    assert main(["logbook", str(bundle)]) == 0
    out = capsys.readouterr().out
    assert out.count("| attempt |") == 4 and "base_model (" in out and "2 attempts, 1 completed, 1 preempted" in out
    assert main(["logbook", str(tmp_path / "sft_model" / "run"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"][0]["outcome"] == "completed"
    with pytest.raises(SystemExit, match="neither a run folder"):
        main(["logbook", str(tmp_path)])


def test_a_training_run_records_mlflow_system_metrics(tmp_path, pretrain_job) -> None:
    from mlflow.tracking import MlflowClient

    from kiln.train.loop import main
    from tests.faults import injector
    from tests.kiln.train.test_train import ListReporter

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
