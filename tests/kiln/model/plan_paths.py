"""What each family's parallelize test checks: every module path of a tensor-parallel plan names modules the built
model has (a path that matched nothing would leave those weights whole on every rank), QK-norm is in the plan exactly
when the model has it, and the pipeline cut names real modules."""

from __future__ import annotations

import fnmatch
from typing import Any, Callable

from kiln.model.config import ModelConfig
from kiln.model.families import family


def check_plan_paths(cfg: ModelConfig, tp_plan: Callable[[ModelConfig], dict[str, Any]]) -> dict[str, Any]:
    """Assert the above for ``cfg``'s family; returns the plan."""
    names = [n for n, _ in family(cfg.family).model(cfg).named_modules()]
    plan = tp_plan(cfg)
    for path in plan:
        assert fnmatch.filter(names, path), f"{path} names no module"
    assert any(p.endswith("q_norm") for p in plan) == cfg.qk_norm
    cut = family(cfg.family).parallelize
    assert cut.first_stage and cut.last_stage and all(p in names for p in cut.first_stage + cut.last_stage)
    return plan
