"""MLflow for an arena: one run per arena (tag ``kiln.arena_id``) in the ``arena`` experiment, reopened on restart.

Params name each model (reference, folder, weights digest); after each vote one ``log_batch`` writes the vote counts
and every model's rating with its interval, at step = the number of votes so far.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

EXPERIMENT = "arena"


def metric_name(name: str) -> str:
    """A model reference as an MLflow key part: characters outside letters, digits, '-', '.' become '_' (paths
    and models:/ references hold '/', ':' and '@'), cut to the last 80."""
    return re.sub(r"[^\w\-.]+", "_", name).strip("_")[-80:] or "model"


class ArenaTracker:
    """Logs an arena's models and its ratings after every vote to MLflow."""

    def __init__(self, tracking_uri: str, arena_id: str, contestants: Sequence, artifact_root: Path | None = None,
                 prompts_from: str = ""):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri)
        self.keys = {c.name: metric_name(c.name) for c in contestants}
        if len(set(self.keys.values())) < len(self.keys):  # two references that differ only in punctuation
            self.keys = {c.name: f"m{i + 1}_{metric_name(c.name)}" for i, c in enumerate(contestants)}
        exp = self.client.get_experiment_by_name(EXPERIMENT)
        if exp is not None:
            exp_id = exp.experiment_id
        else:
            location = artifact_root.resolve().as_uri() if artifact_root is not None else None
            # model development, not GenAI traces: the layout MLflow 3's UI opens it in
            exp_id = self.client.create_experiment(EXPERIMENT, artifact_location=location,
                                                   tags={"mlflow.experimentKind": "custom_model_development"})
        found = self.client.search_runs([exp_id], f"tags.`kiln.arena_id` = '{arena_id}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(exp_id, tags={"kiln.arena_id": arena_id, "mlflow.runName": f"arena {arena_id}"})
            self.run_id = run.info.run_id
            self._log_params(contestants, prompts_from)

    def _log_params(self, contestants: Sequence, prompts_from: str) -> None:
        from mlflow.entities import Param

        params = [Param("prompts", prompts_from[-6000:])]
        for c in contestants:
            key = self.keys[c.name]
            params += [Param(f"model.{key}", c.name), Param(f"model.{key}.path", c.path),
                       Param(f"model.{key}.weights", c.weights)]
        self.client.log_batch(self.run_id, params=params)

    def log_vote(self, step: int, counts: dict[str, int], rows: list[dict[str, Any]]) -> None:
        """Counts (votes, left, right, tie, both_bad) and each row's rating, low, high and votes at ``step``."""
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        metrics = [Metric(k, float(v), ts, step) for k, v in counts.items()]
        for r in rows:
            key = self.keys[r["model"]]
            metrics += [Metric(f"{field}.{key}", float(r[field]), ts, step)
                        for field in ("rating", "low", "high", "votes", "wins")]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
