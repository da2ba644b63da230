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
