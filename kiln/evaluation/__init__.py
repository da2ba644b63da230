"""Kiln evaluation: an lm-eval model adapter (registered as ``kiln``), local held-out tasks and the suite runner.

Importing this package registers the ``kiln`` lm-eval model; see ``kiln.evaluation.suite`` for the CLI.
"""

from kiln.evaluation.adapter import KilnLM
from kiln.evaluation.suite import CHANCE, lm_eval_cli, run_suite, sample_generations
from kiln.evaluation.tasks import TASK_NAMES, NotEnoughDocumentsError, build_tasks

__all__ = [
    "CHANCE",
    "KilnLM",
    "NotEnoughDocumentsError",
    "TASK_NAMES",
    "build_tasks",
    "lm_eval_cli",
    "run_suite",
    "sample_generations",
]
