"""Tests for kiln.model.moe.parallelize: every module path of the tensor-parallel plan names modules the built model
has, and the pipeline cut names real modules (tests/kiln/model/plan_paths.py); the plans themselves run on two gloo
processes in tests/kiln/model/test_tensor_parallel.py."""

from __future__ import annotations

from kiln.model.config import ModelConfig
from kiln.model.families import family
from kiln.model.moe.parallelize import tp_plan
from tests.kiln.model.plan_paths import check_plan_paths


def test_every_plan_path_names_modules_of_the_model() -> None:
    cfg = ModelConfig(family="moe", n_kv_head=2, vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32)
    plan = check_plan_paths(cfg, tp_plan)
    assert "model.layers.*.mlp" in plan  # the mixture whole on every rank


def test_apply_moe_sets_the_balance_group_and_the_auxiliary_gradient_scale() -> None:
    from kiln.model.moe.model import sparse_layers
    from kiln.model.moe.parallelize import apply_moe

    cfg = ModelConfig(family="moe", n_kv_head=2, vocab_size=128, block_size=16, n_layer=3, n_head=4, n_embd=32)
    model = family("moe").model(cfg)
    group, stages = object(), object()
    apply_moe(model, group, grad_accum=4, pp_group=stages, tp=2)
    layers = sparse_layers(model)
    assert len(layers) == 3 and all(m.dp_group is group and m.pp_group is stages for m in layers)
    assert all(m.aux_scale == 1 / 8 for m in layers)  # 4 micro-batches x 2 sequence shards
    # the experts stay whole on every tensor-parallel rank: the plan has no entry inside the mixture
    assert not [p for p in tp_plan(cfg) if ".mlp." in p]
