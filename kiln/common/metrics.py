"""MLflow helpers: batched metric logging from rank 0 and run lookup by tags.

Metrics are buffered and sent with ``log_batch`` (one sqlite commit per batch, not per point). MLflow is imported
only by a logger that has a run to log to: importing it costs a training worker about 2.5 s of start-up.
"""

from __future__ import annotations

import time
from typing import Any

MAX_BATCH = 1000  # MLflow's limit on metrics per log_batch call
# A run's one-off operations figures (cost, energy, goodput) go under MLflow's "system/" namespace: the run page
# then opens its Model metrics tab on the training curves (it sorts a tab's charts by name, so "cost.*" bars came
# first), and these bars sit on the System metrics tab beside CPU, memory and disk. They are logged at step 0:
# MLflow's system-metrics monitor resumes its sample count after the highest step of the run's system/* metrics.
OPERATIONS_PREFIX = "system/kiln."


def operations_metrics(figures: dict[str, Any], group: str = "") -> dict[str, float]:
    """``{system/kiln.<group><name>: value}`` of the numbers in ``figures`` (booleans and text left out)."""
    return {f"{OPERATIONS_PREFIX}{group}{k}": float(v) for k, v in figures.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


class MetricLogger:
    """Buffer metrics and flush them in batches; a no-op when ``run_id`` is empty (not rank 0)."""

    def __init__(self, tracking_uri: str | None, run_id: str | None, flush_every_s: float = 10.0):
        self.run_id = run_id or None
        self.client = None
        if tracking_uri and run_id:
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri)
        self.flush_every_s = flush_every_s
        self._buf: list[Metric] = []
        self._last = time.monotonic()

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.client is None:
            return
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self._buf.extend(Metric(k, float(v), ts, step) for k, v in metrics.items())
        if len(self._buf) >= MAX_BATCH or time.monotonic() - self._last > self.flush_every_s:
            self.flush()

    def log_params(self, params: dict[str, Any]) -> None:
        if self.client is None:
            return
        # a restarted attempt logs into the same run: MLflow refuses a changed value (a re-measured CPU peak), so
        # the first attempt's values stand and the logbook records what changed
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params
        items = [Param(k, str(v)[:6000]) for k, v in flatten(params).items() if k not in logged]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def set_tags(self, tags: dict[str, Any]) -> None:
        if self.client is not None:
            from mlflow.entities import RunTag

            self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def flush(self) -> None:
        if self.client is None:
            return
        while self._buf:
            chunk, self._buf = self._buf[:MAX_BATCH], self._buf[MAX_BATCH:]
            self.client.log_batch(self.run_id, metrics=chunk)
        self._last = time.monotonic()


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
