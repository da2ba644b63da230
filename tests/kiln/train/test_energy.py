"""Tests for the cost and energy figures: the planner's planned costs and compute-optimal size (kiln.plan), the run
ledger with NVML energy counters or the configured watts (kiln.train.energy), the model card's operations section
(kiln.release.card), ``kiln logbook`` on a release, and MLflow's system metrics from a training run.

Run: python -m pytest tests/kiln/train/test_energy.py -q
"""

from __future__ import annotations

import json
import sys
import types

import pytest

from kiln.plan.cost import CostConfig
from kiln.train import logbook
from kiln.train.energy import EnergyMeter, ledger_table, run_ledger
from kiln.train.journal import Journal


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
    section = _operations(summary, up["base_model"]["ledger"])
    assert section.startswith("## Training operations, cost and energy")
    assert "All the training runs above: 1.25 device-hours, 0.125 kWh (partly or wholly estimated), 5 USD." in section
    assert "The plan estimated 0.5 device-hours (0.05 kWh, 2 USD) for the base model." in section
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "kiln.json").write_text(json.dumps({
        "training": {"base_model": {"checkpoint": up["base_model"]["checkpoint"]}},
        "post_training": [{"stage": s, "checkpoint": up[a]["checkpoint"]}
                          for s, a in (("sft", "sft_model"), ("dpo", "dpo_model"), ("rl", "rl_model"))]}))
    from kiln.train.logbook import main  # what `kiln logbook` runs (the core's own test: no Dagster)

    assert main([str(bundle)]) == 0
    out = capsys.readouterr().out
    assert out.count("| attempt |") == 4 and "base_model (" in out and "2 attempts, 1 completed, 1 preempted" in out
    assert main([str(tmp_path / "sft_model" / "run"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"][0]["outcome"] == "completed"
    with pytest.raises(SystemExit, match="neither a run folder"):
        main([str(tmp_path)])
