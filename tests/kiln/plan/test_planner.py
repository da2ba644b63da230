"""Tests of kiln/plan/planner.py: plan_training plans one node without a layout block and a cluster layout with one;
what the plan launches and describes, and config errors named by where the block sits.

Run: python -m pytest tests/kiln/plan/test_planner.py -q
"""

from __future__ import annotations

import pytest

from kiln.common.config import ConfigError
from kiln.plan.cost import describe_costs, load_cost
from kiln.plan.layout import describe_layout_plan
from kiln.plan.memory import describe_plan
from kiln.plan.planner import plan_training

BATCH = {"seq_len": 32, "global_batch": 8, "max_steps": 10}
GPT2 = dict(model_preset="gpt2", batch=dict(seq_len=1024, global_batch=512, max_steps=100),
            hardware=dict(device="cuda", nproc_per_node=1, memory_gb=80, peak_tflops=989.0))


def test_without_a_layout_one_node_is_planned_and_launched_with_its_hardware_and_steps() -> None:
    planned = plan_training(300, "tiny", {}, BATCH, {"memory_gb": 16})
    assert planned.layout is None and planned.single is not None and planned.batch is not None
    assert (planned.model.family, planned.model.vocab_size) == ("gpt2", 320)  # the vocabulary padded
    launch = planned.launch()
    assert launch == {**planned.single.to_dict(), "hardware": planned.hardware, "max_steps": 10}
    assert launch["hardware"]["device"] == "cpu" and launch["hardware"]["memory_gb"] == 16  # "auto" resolved
    assert (launch["global_batch"], launch["seq_len"]) == (8, 32)
    assert planned.describe() == describe_plan(planned.single) + describe_costs(planned.single, load_cost("cpu"))


def test_a_layout_block_plans_the_cluster_and_launches_its_layout() -> None:
    planned = plan_training(50259, **GPT2, layout={}, parallel={"compile": True})
    assert planned.single is None and planned.batch is None and planned.layout is not None
    assert planned.model.vocab_size == 50304 and planned.compile is True
    assert planned.layout.max_steps == 100
    launch = planned.launch()
    assert launch["max_steps"] == 100 and launch["hardware"]["device"] == "cuda"
    assert planned.describe() == describe_layout_plan(planned.layout)


def test_errors_name_the_block_where_it_sits() -> None:
    with pytest.raises(ConfigError, match=r"sweep\.points\[0\]\.model: unknown key 'nope'"):
        plan_training(300, "tiny", {"nope": 1}, BATCH, {"memory_gb": 16}, where="sweep.points[0]")
    with pytest.raises(ConfigError, match="training_plan.layout plans GPU clusters"):
        plan_training(50259, **{**GPT2, "hardware": dict(device="cpu", memory_gb=80)}, layout={})


def test_cpu_bf16_with_a_layout_block_is_an_error_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"training_plan.parallel.cpu_bf16: .* a layout plan trains in fp32 on CPU"):
        plan_training(4099, model={"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64},
                      batch={"seq_len": 64, "global_batch": 8, "max_steps": 10}, hardware={"device": "cpu"},
                      parallel={"cpu_bf16": True}, layout={})
