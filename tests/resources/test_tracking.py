"""MLflow tracking against a real ``mlflow server`` over HTTP (the multi-machine setup): runs nest under their
Dagster run, metrics arrive in batches, artifacts go through the server, and a rerun reuses the recorded output."""

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from dagster import AssetExecutionContext, Output, asset, materialize

from kiln.common.metrics import MetricLogger
from resources.tracking import MlflowResource
from conftest import free_port


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real tracking server on 127.0.0.1 with its own sqlite store and proxied artifact store."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
           "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield url, root
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
        log.close()


def _resource(url: str, tmp_path: Path) -> MlflowResource:
    return MlflowResource(tracking_uri=url, artifact_root=str(tmp_path / "never-used"), experiment="kiln-server-test",
                          ui_url=url)


def test_asset_runs_metrics_and_artifacts_go_through_the_server_and_a_rerun_is_reused(mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    url, server_root = mlflow_server
    calls = []

    @asset(code_version="1")
    def summary(context: AssetExecutionContext, mlflow: MlflowResource) -> Output[dict]:
        with mlflow.asset_run(context, params={"size": 3}, reuse={"size": 3}) as run:
            if run.reused is not None:
                return run.reused
            calls.append(1)
            out = tmp_path / "summary.txt"
            out.write_text("three\n")
            for step in range(5):
                run.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
            run.log_artifact(out)
            return run.output({"path": str(out)}, "v1", {"lines": 1})

    res = _resource(url, tmp_path)
    first = materialize([summary], resources={"mlflow": res})
    assert first.success and calls == [1]
    client = MlflowClient(url)
    exp = client.get_experiment_by_name("kiln-server-test")
    # the server owns the artifact store: nothing is written under the client's local artifact_root
    assert exp.artifact_location.startswith("mlflow-artifacts:")
    assert not (tmp_path / "never-used").exists()
    child = client.search_runs([exp.experiment_id], "tags.`kiln.kind` = 'asset'")
    assert len(child) == 1 and child[0].info.status == "FINISHED"
    parent = client.get_run(child[0].data.tags["mlflow.parentRunId"])
    assert parent.data.tags["dagster.run_id"] == first.run_id and parent.info.status == "FINISHED"
    history = client.get_metric_history(child[0].info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(s, 1.0 / (s + 1)) for s in range(5)]
    assert child[0].data.params["size"] == "3"
    names = {a.path for a in client.list_artifacts(child[0].info.run_id)}
    assert {"summary.txt", "kiln_output.json"} <= names
    stored = list((server_root / "artifacts").rglob("summary.txt"))
    assert len(stored) == 1 and stored[0].read_text() == "three\n"
    # the same inputs, config and code: the recorded output is found through the server and reused
    second = materialize([summary], resources={"mlflow": res})
    assert second.success and calls == [1]
    reused = client.search_runs([exp.experiment_id], f"tags.`dagster.run_id` = '{second.run_id}' and tags.`kiln.kind` = 'asset'")
    assert reused[0].data.tags["kiln.reused_from"] == child[0].info.run_id


def test_worker_metric_logger_sends_thousands_of_points_in_batches(mlflow_server):
    from mlflow.tracking import MlflowClient

    url, _ = mlflow_server
    client = MlflowClient(url)
    exp = client.get_experiment_by_name("kiln-server-test") or client.get_experiment(client.create_experiment("kiln-server-test"))
    run = client.create_run(exp.experiment_id)
    logger = MetricLogger(url, run.info.run_id, flush_every_s=3600)
    for step in range(1200):
        logger.log({"train_loss": 5.0 - step / 1000, "tokens_per_s": 1000.0 + step}, step)
    logger.flush()
    got = client.get_metric_history(run.info.run_id, "train_loss")
    assert len(got) == 1200 and got[-1].step == 1199 and got[-1].value == pytest.approx(5.0 - 1.199)
    assert len(client.get_metric_history(run.info.run_id, "tokens_per_s")) == 1200
    assert MetricLogger(url, "").client is None  # other ranks log nothing
