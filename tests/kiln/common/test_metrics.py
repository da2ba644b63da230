"""Tests for kiln.common.metrics: the operations figures named under MLflow's system/ namespace, nested params
flattened, a logger without a run doing nothing (MLflow not even imported), and against a real ``mlflow server``:
metrics sent in batches of MAX_BATCH, params of a restarted attempt keeping the first attempt's values, and tags.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kiln.common.metrics import MAX_BATCH, MetricLogger, flatten, operations_metrics
from mlflow_server import running_server

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real tracking server on 127.0.0.1 with its own sqlite store and proxied artifact store."""
    root = tmp_path_factory.mktemp("mlflow-server")
    with running_server(root) as url:
        yield url, root


def new_run(url: str) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(url)
    exp = client.get_experiment_by_name("kiln-metrics-test")
    exp_id = exp.experiment_id if exp else client.create_experiment("kiln-metrics-test")
    return client.create_run(exp_id).info.run_id


def test_operations_metrics_keep_the_numbers_under_the_system_namespace():
    figures = {"usd": 1.5, "steps": 3, "spot": True, "device": "cpu", "energy_j": None}
    got = operations_metrics(figures, "cost.")
    assert got == {"system/kiln.cost.usd": 1.5, "system/kiln.cost.steps": 3.0}  # booleans, text and None left out
    assert all(type(v) is float for v in got.values())
    assert operations_metrics({"goodput": 0.75}) == {"system/kiln.goodput": 0.75}


def test_flatten_joins_nested_keys_with_dots():
    params = {"optim": {"lr": 0.01, "betas": {"b1": 0.9}}, "layers": [1, 2], "empty": {}, "name": "x"}
    assert flatten(params) == {"optim.lr": 0.01, "optim.betas.b1": 0.9, "layers": [1, 2], "name": "x"}
    assert flatten({"a": 1}, "job.") == {"job.a": 1}


def test_a_logger_without_a_run_logs_nothing_and_never_imports_mlflow():
    code = ("import sys\n"
            "from kiln.common.metrics import MetricLogger\n"
            "for uri, run in ((None, 'r1'), ('sqlite:///x.db', ''), ('sqlite:///x.db', None)):\n"
            "    m = MetricLogger(uri, run)\n"
            "    m.log({'loss': 1.0}, 0); m.log_params({'a': 1}); m.set_tags({'t': 1}); m.flush()\n"
            "    assert m.client is None and m._buf == [], (uri, run)\n"
            "print('mlflow' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_worker_metric_logger_sends_thousands_of_points_in_batches(mlflow_server):
    from mlflow.tracking import MlflowClient

    url, _ = mlflow_server
    client = MlflowClient(url)
    exp = (client.get_experiment_by_name("kiln-server-test")
           or client.get_experiment(client.create_experiment("kiln-server-test")))
    run = client.create_run(exp.experiment_id)
    logger = MetricLogger(url, run.info.run_id, flush_every_s=3600)
    for step in range(1200):
        logger.log({"train_loss": 5.0 - step / 1000, "tokens_per_s": 1000.0 + step}, step)
    logger.flush()
    got = client.get_metric_history(run.info.run_id, "train_loss")
    assert len(got) == 1200 and got[-1].step == 1199 and got[-1].value == pytest.approx(5.0 - 1.199)
    assert len(client.get_metric_history(run.info.run_id, "tokens_per_s")) == 1200
    assert MetricLogger(url, "").client is None  # other ranks log nothing


def test_a_full_buffer_is_sent_without_waiting_for_the_clock(mlflow_server):
    from mlflow.tracking import MlflowClient

    url, _ = mlflow_server
    run_id = new_run(url)
    logger = MetricLogger(url, run_id, flush_every_s=3600)
    logger.log({f"m{i}": float(i) for i in range(MAX_BATCH - 1)}, step=0)
    assert len(logger._buf) == MAX_BATCH - 1  # held back: not full, not due
    logger.log({"last": 7.0}, step=1)
    assert logger._buf == []
    metrics = MlflowClient(url).get_run(run_id).data.metrics
    assert len(metrics) == MAX_BATCH and metrics["m998"] == 998.0 and metrics["last"] == 7.0


def test_a_restarted_attempt_keeps_the_first_params_and_adds_new_ones(mlflow_server):
    from mlflow.tracking import MlflowClient

    url, _ = mlflow_server
    run_id = new_run(url)
    first = MetricLogger(url, run_id)
    first.log_params({"optim": {"lr": 0.01}, "cpu_peak": "1.5 GiB", "note": "x" * 7000})
    again = MetricLogger(url, run_id)  # the restarted attempt logs into the same run
    again.log_params({"optim": {"lr": 0.02}, "cpu_peak": "1.7 GiB", "resumed_from": 30})
    again.set_tags({"kiln.kind": "train", "kiln.attempts": 2})
    data = MlflowClient(url).get_run(run_id).data
    assert {k: v for k, v in data.params.items() if k != "note"} == {"optim.lr": "0.01", "cpu_peak": "1.5 GiB",
                                                                     "resumed_from": "30"}
    assert data.params["note"] == "x" * 6000  # cut to what MLflow stores
    assert data.tags["kiln.kind"] == "train" and data.tags["kiln.attempts"] == "2"


def test_a_spooled_worker_never_imports_mlflow_and_its_launcher_sends_what_it_wrote(mlflow_server, tmp_path):
    """A worker under a forwarding launcher (SPOOL_ENV) writes its records to the spool without loading MLflow; the
    forwarder sends metrics with their own steps and times, keeps a restarted attempt's first params, sets tags, logs
    the JSON artifact, records what it sent, and leaves a line still being written for its next pass."""
    import json
    import os
    import time

    from mlflow.tracking import MlflowClient

    from kiln.common.metrics import SPOOL_ENV, SpoolForwarder

    url, _ = mlflow_server
    run_id = new_run(url)
    spool = tmp_path / "tracking.jsonl"
    code = ("import sys\n"
            "from kiln.common.metrics import job_logger\n"
            f"log = job_logger({url!r}, {run_id!r})\n"
            "log.log_params({'optim': {'lr': 0.01}}); log.set_tags({'kiln.kind': 'train'})\n"
            "for step in range(1500):\n"
            "    log.log({'loss': 10.0 - step / 1000, 'lr': 0.01}, step)\n"
            "log.flush(); log.log_params({'optim': {'lr': 0.02}, 'resumed_from': 3})\n"
            "log.log_dict({'rows': [1, 2]}, 'before_after.json')\n"
            "print(type(log).__name__, 'mlflow' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, SPOOL_ENV: str(spool)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["SpoolLogger", "False"]
    assert all(json.loads(line)["run"] == run_id for line in spool.read_text().splitlines())
    with open(spool, "a") as f:  # a worker halfway through its next line
        f.write('{"op": "tags", "uri": ')
    written_by = time.time() * 1000
    forwarder = SpoolForwarder(spool)
    assert forwarder.forward() == 7  # params, tags, three batches of 1,000 points, params, dict
    client = MlflowClient(url)
    data = client.get_run(run_id).data
    assert data.params == {"optim.lr": "0.01", "resumed_from": "3"} and data.tags["kiln.kind"] == "train"
    history = client.get_metric_history(run_id, "loss")
    assert [m.step for m in history] == list(range(1500)) and history[-1].value == pytest.approx(8.501)
    assert all(1.7e12 < m.timestamp <= written_by for m in history)  # the times the worker logged them at
    assert "before_after.json" in [a.path for a in client.list_artifacts(run_id)]
    sent = int(spool.with_name("tracking.jsonl.sent").read_text())
    assert sent == spool.stat().st_size - len('{"op": "tags", "uri": ')
    with open(spool, "a") as f:  # the line ends; a later forwarder (the next launch) sends only it
        f.write(json.dumps(url) + f', "run": "{run_id}", "tags": {{"kiln.attempts": "2"}}}}\n')
    again = SpoolForwarder(spool, interval_s=0.05).start()
    again.stop()
    assert client.get_run(run_id).data.tags["kiln.attempts"] == "2"
    assert len(client.get_metric_history(run_id, "loss")) == 1500  # nothing sent twice
    assert int(spool.with_name("tracking.jsonl.sent").read_text()) == spool.stat().st_size
