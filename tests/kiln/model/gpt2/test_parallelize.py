"""Tests for kiln.model.gpt2.parallelize: every module path of the tensor-parallel plan names modules the built model
has (a path that matched nothing would leave those weights whole on every rank), and the pipeline cut names real
modules; the plans themselves run on two gloo processes in tests/kiln/model/test_tensor_parallel.py."""

from __future__ import annotations

import fnmatch

from kiln.model.config import ModelConfig
from kiln.model.families import family
from kiln.model.gpt2.parallelize import tp_plan


def test_every_plan_path_names_modules_of_the_model() -> None:
    qk_norm = False  # GPT-2 has none
    cfg = ModelConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32)
    assert cfg.qk_norm == qk_norm
    names = [n for n, _ in family("gpt2").model(cfg).named_modules()]
    plan = tp_plan(cfg)
    for path in plan:
        assert fnmatch.filter(names, path), f"{path} names no module"
    assert any(p.endswith("q_norm") for p in plan) == qk_norm
    cut = family("gpt2").parallelize
    assert cut.first_stage and cut.last_stage and all(p in names for p in cut.first_stage + cut.last_stage)
