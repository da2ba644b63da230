"""Tests for kiln.model.llama.parallelize: every module path of the tensor-parallel plan names modules the built model
has, and the pipeline cut names real modules (tests/kiln/model/plan_paths.py); the plans themselves run on two gloo
processes in tests/kiln/model/test_tensor_parallel.py."""

from __future__ import annotations

import pytest

from kiln.model.config import ModelConfig
from kiln.model.llama.parallelize import tp_plan
from tests.kiln.model.plan_paths import check_plan_paths


@pytest.mark.parametrize("qk_norm", [False, True])
def test_every_plan_path_names_modules_of_the_model(qk_norm) -> None:
    cfg = ModelConfig(family="llama", n_kv_head=2, qk_norm=qk_norm, vocab_size=128, block_size=16, n_layer=2,
                      n_head=4, n_embd=32)
    plan = check_plan_paths(cfg, tp_plan)
    assert "model.layers.*.mlp.gate_proj" in plan
