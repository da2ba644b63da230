"""MLflow helpers: batched metric logging from rank 0 and run lookup by tags.

Metrics are buffered and sent with ``log_batch`` (one sqlite commit per batch, not per point). MLflow is imported
only by a logger that has a run to log to: importing it and opening its store cost a training worker about 2.5 s of
start-up and 0.5 s of exit. A worker whose launcher runs beside it and has MLflow loaded already (resources.torchrun's
local launcher sets SPOOL_ENV) does neither: ``job_logger`` gives it a ``SpoolLogger``, which appends what it would
send as JSON lines to a file, and the launcher's ``SpoolForwarder`` sends them to MLflow as they come (with the
points' own times and steps) and the rest once the workers end.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
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
        self.sends = self.client is not None  # False: every call is a no-op
        self.flush_every_s = flush_every_s
        self._buf: list[tuple[str, float, int, int]] = []
        self._last = time.monotonic()

    def log(self, metrics: dict[str, float], step: int) -> None:
        ts = int(time.time() * 1000)
        self.log_points([(k, float(v), ts, step) for k, v in metrics.items()])

    def log_points(self, points: list[tuple[str, float, int, int]]) -> None:
        """(key, value, milliseconds since the epoch, step) points logged at their own times (a spool's)."""
        if not self.sends:
            return
        self._buf.extend((k, v, ts, step) for k, v, ts, step in points)
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

    def log_dict(self, data: dict[str, Any], artifact_file: str) -> None:
        """``data`` as a JSON artifact of the run."""
        if self.client is not None:
            self.client.log_dict(self.run_id, data, artifact_file)

    def flush(self) -> None:
        if not self.sends:
            return
        while self._buf:
            chunk, self._buf = self._buf[:MAX_BATCH], self._buf[MAX_BATCH:]
            self._send_points(chunk)
        self._last = time.monotonic()

    def _send_points(self, points: list[tuple[str, float, int, int]]) -> None:
        from mlflow.entities import Metric

        self.client.log_batch(self.run_id, metrics=[Metric(*p) for p in points])  # type: ignore[union-attr]


SPOOL_ENV = "KILN_TRACKING_SPOOL"  # a file a worker appends its MLflow records to, for its launcher to send


def job_logger(tracking_uri: str | None, run_id: str | None) -> MetricLogger:
    """A training worker's logger for its job's run: a SpoolLogger into SPOOL_ENV's file when its launcher forwards
    (no MLflow import here), else a MetricLogger that sends to the store itself (Slurm, a plain torchrun)."""
    spool = os.environ.get(SPOOL_ENV)
    if spool and tracking_uri and run_id:
        return SpoolLogger(Path(spool), tracking_uri, run_id)
    return MetricLogger(tracking_uri, run_id)


class SpoolLogger(MetricLogger):
    """A MetricLogger whose records (metrics buffered and batched as MetricLogger's, params, tags, JSON artifacts)
    are appended to ``path`` as JSON lines (``op`` metrics, params, tags or dict, with the run each is for) for a
    SpoolForwarder to send; MLflow is never imported."""

    def __init__(self, path: Path, tracking_uri: str, run_id: str, flush_every_s: float = 10.0):
        super().__init__(None, None, flush_every_s)
        self.path, self.uri, self.run_id, self.sends = Path(path), tracking_uri, run_id, True

    def _append(self, op: str, **fields: Any) -> None:
        line = json.dumps({"op": op, "uri": self.uri, "run": self.run_id, **fields}) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:  # one write of a whole line: a reader never sees half
            f.write(line)

    def _send_points(self, points: list[tuple[str, float, int, int]]) -> None:
        self._append("metrics", points=points)

    def log_params(self, params: dict[str, Any]) -> None:
        self._append("params", params=flatten(params))

    def set_tags(self, tags: dict[str, Any]) -> None:
        self._append("tags", tags={k: str(v) for k, v in tags.items()})

    def log_dict(self, data: dict[str, Any], artifact_file: str) -> None:
        self._append("dict", data=data, artifact_file=artifact_file)


class SpoolForwarder:
    """Sends a spool file's records (SpoolLogger) to MLflow: every ``interval_s`` in a thread while the workers run,
    and the rest at ``stop()``. What it has sent is recorded beside the file (``<file>.sent``, the byte offset), so a
    launch that ended before sending everything (its launcher killed) leaves the rest to the next launch of the
    same run folder; a line not yet ended (a worker writing it) waits for the next pass."""

    def __init__(self, path: Path, interval_s: float = 2.0):
        self.path, self.interval_s = Path(path), interval_s
        self.sent_path = self.path.with_name(self.path.name + ".sent")
        self._loggers: dict[tuple[str, str], MetricLogger] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> "SpoolForwarder":
        self._thread = threading.Thread(target=self._run, name="kiln-spool-forwarder", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.forward()
            except Exception:  # a busy store: the next pass, or stop(), sends it
                pass

    def stop(self) -> None:
        """End the thread and send everything written so far (an error from the store is raised here)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self.forward()

    def forward(self) -> int:
        """Send the records written since the last pass; the number sent."""
        with self._lock:
            if not self.path.exists():
                return 0
            try:
                offset = int(self.sent_path.read_text())
            except (OSError, ValueError):
                offset = 0
            if offset > self.path.stat().st_size:  # the file was replaced since: it is all new
                offset = 0
            with open(self.path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1
            sent = 0
            for line in chunk[:end].splitlines():
                if line.strip():
                    self._send(json.loads(line))
                    sent += 1
            for logger in self._loggers.values():
                logger.flush()
            if end:
                from kiln.common.files import atomic_write_text

                atomic_write_text(self.sent_path, str(offset + end))
            return sent

    def _send(self, record: dict[str, Any]) -> None:
        key = (record["uri"], record["run"])
        if key not in self._loggers:
            self._loggers[key] = MetricLogger(*key)
        logger = self._loggers[key]
        op = record["op"]
        if op == "metrics":
            logger.log_points(record["points"])
        elif op == "params":
            logger.log_params(record["params"])
        elif op == "tags":
            logger.set_tags(record["tags"])
        elif op == "dict":
            logger.flush()
            logger.log_dict(record["data"], record["artifact_file"])


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
