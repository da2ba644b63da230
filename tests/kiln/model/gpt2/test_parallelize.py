"""Tests for kiln.model.gpt2.parallelize: every module path of the tensor-parallel plan names modules the built model
has, and the pipeline cut names real modules (tests/kiln/model/plan_paths.py); the plans themselves run on two gloo
processes in tests/kiln/model/test_tensor_parallel.py."""

from __future__ import annotations

from kiln.model.config import ModelConfig
from kiln.model.gpt2.parallelize import tp_plan
from tests.kiln.model.plan_paths import check_plan_paths


def test_every_plan_path_names_modules_of_the_model() -> None:
    plan = check_plan_paths(ModelConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32), tp_plan)
    assert "transformer.h.*.attn.c_attn" in plan  # the fused q | k | v, split by heads within each
