"""Tests of kiln/plan/cost.py: compute-optimal is twenty tokens per parameter at the same budget, the planned costs and
plan lines for GPT-2 on 8 GPUs, and cost settings from conf with unknown keys as errors."""

from __future__ import annotations

import pytest

from kiln.model.config import ModelConfig, preset_fields
from kiln.plan.cost import CostConfig, compute_optimal, describe_costs, load_cost, planned_costs
from kiln.plan.memory import BatchConfig, HardwareConfig, PlanError, make_plan


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
