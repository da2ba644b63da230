"""Kiln evaluation: an lm-eval model adapter (registered as ``kiln``), local tasks (held-out text, MMLU), the suite
runner, the n-gram contamination check and checkpoint discovery for per-checkpoint scores.

Importing this package registers the ``kiln`` lm-eval model; see ``kiln.evaluation.suite`` for the CLI.
"""

from kiln.evaluation.adapter import KilnLM
from kiln.evaluation.contamination import DEFAULT_N, check_contamination
from kiln.evaluation.mmlu import MMLU, build_mmlu_task
from kiln.evaluation.suite import CHANCE, lm_eval_cli, run_suite, sample_generations, score_full_and_clean
from kiln.evaluation.tasks import TASK_NAMES, NotEnoughDocumentsError, build_tasks, retarget_tasks

__all__ = [
    "CHANCE",
    "DEFAULT_N",
    "KilnLM",
    "MMLU",
    "NotEnoughDocumentsError",
    "TASK_NAMES",
    "build_mmlu_task",
    "build_tasks",
    "check_contamination",
    "lm_eval_cli",
    "retarget_tasks",
    "run_suite",
    "sample_generations",
    "score_full_and_clean",
]
