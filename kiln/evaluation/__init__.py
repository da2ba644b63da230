"""Kiln evaluation: the eval task registry, the lm-eval adapter (importing registers model ``kiln``), suite, contamination.

Run: ``python -m kiln.evaluation.registry`` lists the tasks; ``python -m kiln.evaluation.suite --model kiln ...`` scores.
"""

from kiln.evaluation.adapter import KilnLM
from kiln.evaluation.contamination import DEFAULT_N, check_contamination
from kiln.evaluation.mmlu import MMLU, build_mmlu_task
from kiln.evaluation.registry import REGISTRY, TaskRegistry, UnknownTaskError
from kiln.evaluation.spec import FromDocuments, FromPackage, TaskSpec, TaskSpecError
from kiln.evaluation.suite import CHANCE, lm_eval_cli, run_suite, sample_generations, score_full_and_clean
from kiln.evaluation.tasks import TASK_NAMES, NotEnoughDocumentsError, build_suite, build_tasks, retarget_tasks

__all__ = [
    "CHANCE",
    "DEFAULT_N",
    "FromDocuments",
    "FromPackage",
    "KilnLM",
    "MMLU",
    "NotEnoughDocumentsError",
    "REGISTRY",
    "TASK_NAMES",
    "TaskRegistry",
    "TaskSpec",
    "TaskSpecError",
    "UnknownTaskError",
    "build_mmlu_task",
    "build_suite",
    "build_tasks",
    "check_contamination",
    "lm_eval_cli",
    "retarget_tasks",
    "run_suite",
    "sample_generations",
    "score_full_and_clean",
]
