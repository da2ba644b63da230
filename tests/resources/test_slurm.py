"""The `launcher: slurm` path on a real one-node Slurm cluster (scripts/slurm-cluster.sh: munged, slurmctld, slurmd on
127.0.0.1): a training asset submits its sbatch job and follows it to the end, and a job cancelled mid-run with
scancel saves its step, is reported preempted, and the retry's new sbatch job resumes from that checkpoint.

Run: python -m pytest tests/resources/test_slurm.py -q   (needs root and Debian's slurm-wlm and munge; CI installs them)
"""

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from dagster import AssetExecutionContext, DagsterInstance, Output, asset, materialize

from kiln.train.launch import RunSpec
from kiln.train.logbook import attempts
from resources.storage import KilnStorageResource
from resources.torchrun import TorchrunResource
from resources.tracking import MlflowResource

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("slurmctld") is None or os.geteuid() != 0,
                                 reason="needs root and Slurm: not installed (apt-get install -y slurm-wlm munge; make test does it as root)")]


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A one-node cluster for the whole session, on its own ports, stopped at the end; SLURM_CONF points at it."""
    from ports import free_port

    folder = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "SLURMCTLD_PORT": str(free_port()), "SLURMD_PORT": str(free_port()), "KILL_WAIT": "30"}
    script = str(ROOT / "scripts" / "slurm-cluster.sh")
    up = subprocess.run([script, "start", str(folder)], env=env, capture_output=True, text=True, timeout=180)
    assert up.returncode == 0, up.stdout + up.stderr + _logs(folder)
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(folder / "slurm.conf")
    try:
        yield folder
    finally:
        subprocess.run([script, "stop", str(folder)], env=env, capture_output=True, timeout=60)
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before


def _logs(folder: Path) -> str:
    return "".join(f"\n--- {p}\n{p.read_text()[-2000:]}" for p in sorted((folder / "log").glob("*.log"))) \
        if (folder / "log").exists() else ""


def training_asset(job: dict, code_version: str | None = None):
    """A training asset built like base_model: its RunSpec, torchrun.training_run, launch (or the reused run),
    output with metadata."""
    fields = {k: v for k, v in job.items() if k not in ("task", "out_dir", "tokenizer", "model", "seq_len",
                                                        "micro_batch", "grad_accum")}
    plan = {"model": job["model"], "seq_len": job["seq_len"], "micro_batch": job["micro_batch"],
            "grad_accum": job["grad_accum"], "world_size": 1, "est_hours": 0.002,
            "hardware": {"device": "cpu", "nproc_per_node": 1, "nnodes": 1}}
    spec = RunSpec("pretrain", fields, plan, {"token_shards": "test"}, job["tokenizer"])

    @asset(code_version=code_version)
    def trained(context: AssetExecutionContext, torchrun: TorchrunResource, storage: KilnStorageResource,
                mlflow: MlflowResource) -> Output[dict]:
        with torchrun.training_run(context, spec, storage, mlflow) as launch:
            if launch.reused:
                return launch.reused
            result = launch.launch()
            return launch.output({"steps": result["steps"]})

    return trained


def resources(tmp_path: Path, worker: str = "resources.pipes_worker") -> dict:
    return {"torchrun": TorchrunResource(launcher="slurm", timeout_s=600, slurm_poll_s=0.5, preempt_retry_wait_s=0.5,
                                         worker=worker),
            "storage": KilnStorageResource(root=str(tmp_path / "storage")),
            "mlflow": MlflowResource(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                                     artifact_root=str(tmp_path / "mlartifacts"))}


def user_logs(instance, run_id) -> list[str]:
    return [e.user_message for e in instance.all_logs(run_id) if e.dagster_event is None]


def materialization(instance, run_id):
    [event] = [e.dagster_event for e in instance.all_logs(run_id)
               if e.dagster_event is not None and e.dagster_event.event_type_value == "ASSET_MATERIALIZATION"]
    return event.event_specific_data.materialization


def test_an_sbatch_training_job_is_followed_to_completion(slurm_cluster, tmp_path, pretrain_job):
    job = json.loads(pretrain_job(tmp_path, max_steps=12, ckpt_interval=6, eval_interval=6, log_interval=3,
                                  system_metrics_s=1.0).read_text())
    instance = DagsterInstance.ephemeral()
    result = materialize([training_asset(job)], instance=instance, resources=resources(tmp_path))
    value = result.output_for_node("trained")
    assert value["steps"] == 12 and value["outcome"] == "completed"
    job_id = value["slurm_job_id"]
    logs = user_logs(instance, result.run_id)
    assert any(m.startswith(f"Slurm job {job_id} submitted") for m in logs)
    assert any(m.startswith(f"Slurm job {job_id}: RUNNING on localhost") for m in logs)
    assert any(m.startswith(f"Slurm job {job_id}: COMPLETED") for m in logs)
    assert any("step 12/12" in m for m in logs), "rank 0's progress reaches the Dagster log through Pipes"
    meta = materialization(instance, result.run_id).metadata
    assert meta["slurm_job_id"].value == job_id and "| 1.0 |" in meta["logbook"].value
    assert meta["device_hours"].value > 0 and "estimate" in meta["energy_basis"].value
    assert "cpu_utilization_percentage" in meta["system_metrics_peaks"].value
    [row] = value["logbook"]
    assert row["outcome"] == "completed" and row["slurm_job_id"] == job_id


def test_scancel_mid_run_saves_the_step_and_the_next_sbatch_job_resumes_from_it(slurm_cluster, tmp_path, pretrain_job,
                                                                                 monkeypatch):
    from tests.faults import Faults

    monkeypatch.setenv("KILN_FAULTS", str(Faults(step_sleep_s=0.3).write(tmp_path / "faults.json")))
    job = json.loads(pretrain_job(tmp_path, max_steps=30, ckpt_interval=100, eval_interval=10, log_interval=1)
                     .read_text())
    cancelled: list[str] = []

    def cancel_at_step_8() -> None:
        deadline = time.time() + 300
        while time.time() < deadline and not cancelled:
            for log in (tmp_path / "storage" / "trained").glob("*/train.log"):
                if "step 8/30" in log.read_text(errors="replace"):
                    ids = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
                    subprocess.run(["scancel", *ids], check=True)
                    cancelled.extend(ids)
                    return
            time.sleep(0.1)

    threading.Thread(target=cancel_at_step_8, daemon=True).start()
    instance = DagsterInstance.ephemeral()
    result = materialize([training_asset(job)], instance=instance, resources=resources(tmp_path, "tests.faults"))  # slow steps: time to cancel mid-run
    value = result.output_for_node("trained")
    assert len(cancelled) == 1, "the first job was cancelled mid-run"
    rows = attempts(Path(value["out_dir"]))
    assert [(r["attempt"], r["outcome"]) for r in rows] == [("1.0", "preempted"), ("2.0", "completed")], rows
    saved = rows[0]["to_step"]
    assert saved >= 8 and rows[0]["steps_lost"] == 0 and rows[0]["note"] == "SIGTERM"
    assert rows[0]["slurm_job_id"] == cancelled[0] != rows[1]["slurm_job_id"] == value["slurm_job_id"]
    assert rows[1]["from_step"] == saved and value["resumed_from"].endswith(f"step_{saved:07d}")
    assert value["steps"] == 30 and value["outcome"] == "completed"
    logs = user_logs(instance, result.run_id)
    assert any(m.startswith(f"Slurm job {cancelled[0]}: CANCELLED") for m in logs)
    events = [e.dagster_event for e in instance.all_logs(result.run_id) if e.dagster_event is not None]
    assert [e.event_type_value for e in events].count("STEP_UP_FOR_RETRY") == 1
    assert not [e for e in events if e.event_type_value == "STEP_FAILURE"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("kiln").experiment_id],
                              "tags.`dagster.asset_key` = 'trained'", order_by=["attributes.start_time ASC"])
    assert [(r.info.status, r.data.tags.get("kiln.outcome")) for r in runs] == [("KILLED", "preempted"),
                                                                                ("FINISHED", "completed")]
