"""Tests for kiln.model.llama.parallelize: every module path of the tensor-parallel plan names modules the built model
has (a path that matched nothing would leave those weights whole on every rank), and the pipeline cut names real
modules; the plans themselves run on two gloo processes in tests/kiln/model/test_tensor_parallel.py."""

from __future__ import annotations

import fnmatch

import pytest

from kiln.model.config import ModelConfig
from kiln.model.families import family
from kiln.model.llama.parallelize import tp_plan


@pytest.mark.parametrize("qk_norm", [False, True])
def test_every_plan_path_names_modules_of_the_model(qk_norm) -> None:
    cfg = ModelConfig(family="llama", n_kv_head=2, qk_norm=qk_norm, vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32)
    assert cfg.qk_norm == qk_norm
    names = [n for n, _ in family("llama").model(cfg).named_modules()]
    plan = tp_plan(cfg)
    for path in plan:
        assert fnmatch.filter(names, path), f"{path} names no module"
    assert any(p.endswith("q_norm") for p in plan) == qk_norm
    cut = family("llama").parallelize
    assert cut.first_stage and cut.last_stage and all(p in names for p in cut.first_stage + cut.last_stage)
