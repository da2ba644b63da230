"""kiln.plan.record: the training plan as a typed record, whose dict form is the plan launch() returns, key for key."""

import pytest

from kiln.common.config import RecordError
from kiln.plan.planner import plan_training
from kiln.plan.record import OPTIONAL, PlanRecord

SMALL = dict(model={"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64},
             batch={"seq_len": 64, "global_batch": 8, "max_steps": 10}, hardware={"nproc_per_node": 2},
             parallel={"cpu_bf16": False})  # fp32 on any CPU: no optional key
SPLIT = dict(model_preset="llama3.2-1b", model={"family": "llama"}, batch=dict(seq_len=2048, global_batch=256, max_steps=10),
             hardware=dict(device="cuda", nproc_per_node=8, nnodes=2, memory_gb=4, peak_tflops=989.0),
             parallel={"strategy": "fsdp"}, layout={"inter_node_gb_s": 5.0})


def test_a_single_node_plan_reads_back_as_the_same_dict_without_the_optional_keys():
    planned = plan_training(4099, **SMALL)
    plan = planned.launch()
    assert plan == {**planned.single.to_dict(), "hardware": planned.hardware, "max_steps": 10}
    record = PlanRecord.from_dict(plan)
    assert record.to_dict() == plan and list(record.to_dict()) == list(plan)
    assert (record.world_size, record.parallelism, record.max_steps) == (2, "ddp", 10)
    assert not set(OPTIONAL) & set(plan)  # none set: none in the dict (the plan hashes as it always did)


def test_a_bf16_cpu_plan_reads_back_with_its_cpu_bf16_key():
    plan = plan_training(4099, **{**SMALL, "parallel": {"cpu_bf16": True}}).launch()
    assert plan["cpu_bf16"] is True and PlanRecord.from_dict(plan).to_dict() == plan


def test_a_split_layout_keeps_its_mesh_block():
    plan = plan_training(128256, **SPLIT).launch()
    record = PlanRecord.from_dict(plan)
    assert record.layout == plan["layout"] and record.layout["tp"] > 1
    assert record.to_dict() == plan


def test_the_assets_additions_appear_only_when_set():
    record = PlanRecord.from_dict(plan_training(4099, **SMALL).launch())
    grown = record.with_(epochs=0.5, sizing="law: ...", scaling=None)
    assert grown.to_dict() == {**record.to_dict(), "sizing": "law: ...", "epochs": 0.5}
    assert list(grown.to_dict())[-2:] == ["sizing", "epochs"]
    with pytest.raises(RecordError, match="'epoch'"):
        record.with_(epoch=1.0)


def test_a_missing_or_undeclared_key_is_named():
    plan = plan_training(4099, **SMALL).launch()
    with pytest.raises(RecordError, match=r"training_plan: no 'seq_len'"):
        PlanRecord.from_dict({k: v for k, v in plan.items() if k != "seq_len"})
    with pytest.raises(RecordError, match=r"unknown key 'epocs'"):
        PlanRecord.from_dict({**plan, "epocs": 1.0})
