"""The torchrun launcher: its command line and Slurm and Kubernetes files are kiln.train.cluster's (rendered there,
tested in tests/kiln/train/test_cluster.py) for its settings, a two-process gloo job through Pipes, torchrun
restarting a killed worker, a Dagster retry that resumes, timeouts and failures, a full disk that ends the launch at
once, and torchrun and its workers ending with the process that launched them."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dagster import AssetExecutionContext, DagsterInstance, Failure, Output, RetryPolicy, asset, materialize

from kiln.train.cluster import TorchrunSpec
from kiln.train.loop import main
from resources.torchrun import TorchrunResource
from tests.conftest import LineReporter, single_thread
from tests.kiln.train.test_trainer import assert_same_final_state

ROOT = Path(__file__).resolve().parents[2]


def test_the_resource_renders_what_kiln_train_cluster_renders_for_its_settings():
    res = TorchrunResource(nnodes=4, node_rank=2, rdzv_endpoint="node0:29500", rdzv_id="rid", max_restarts=2,
                           timeout_s=36 * 3600 + 90, pg_timeout_s=900, python="/opt/py", slurm_signal_s=90)
    spec = TorchrunSpec(nnodes=4, node_rank=2, rdzv_endpoint="node0:29500", rdzv_id="rid", max_restarts=2,
                        timeout_s=36 * 3600 + 90, pg_timeout_s=900, python="/opt/py", slurm_signal_s=90,
                        worker="resources.pipes_worker")
    assert res.torchrun_spec() == spec
    assert res.command(8, Path("/runs/a/job.json"), "cpu", "run1") == spec.command(8, Path("/runs/a/job.json"), "cpu", "run1")
    assert res.command(8, "j.json", "cuda", python="p", rdzv_endpoint="h:1", node_rank=-1, rdzv_id="z", worker="w") \
        == spec.command(8, "j.json", "cuda", python="p", rdzv_endpoint="h:1", node_rank=-1, rdzv_id="z", worker="w")
    assert res.slurm_script("/shared/runs/x/job.json", 8, "cuda", "/opt/kiln", "abc", partition="gpu", account="ml",
                            cpus_per_node=96, output="/o.log") \
        == spec.slurm_script("/shared/runs/x/job.json", 8, "cuda", "/opt/kiln", "abc", partition="gpu", account="ml",
                             cpus_per_node=96, output="/o.log")
    assert res.k8s_manifests("/data/j.json", 8, "cuda", "img", "Run_42", pvc="runs", mount="/m", workdir="/w",
                             namespace="ml", cpus_per_node=16, memory_gb=32) \
        == spec.k8s_manifests("/data/j.json", 8, "cuda", "img", "Run_42", pvc="runs", mount="/m", workdir="/w",
                              namespace="ml", cpus_per_node=16, memory_gb=32)
    assert res.k8s_pipes_pod_spec(8, "cuda", pvc="runs", mount="/m", workdir="/w", cpus=4, memory_gb=8) \
        == spec.k8s_pipes_pod_spec(8, "cuda", pvc="runs", mount="/m", workdir="/w", cpus=4, memory_gb=8)


def test_the_workers_run_the_resources_worker_module():
    assert TorchrunResource(nnodes=2, rdzv_endpoint="node0:29500").command(1, "j.json", "cpu")[-7] == "resources.pipes_worker"
    res = TorchrunResource(nnodes=2, rdzv_endpoint="node0:29500", worker="tests.faults")  # as the fault tests run
    assert res.command(1, "j.json", "cpu")[-7] == "tests.faults"
    assert res.command(1, "j.json", "cpu", worker="other")[-7] == "other"
    assert " -m tests.faults " in res.slurm_script("/shared/runs/x/job.json", 1, "cpu", "/opt/kiln").splitlines()[-1]
    assert "tests.faults" in res.k8s_manifests("/d/j.json", 1, "cpu", "img")[1]["spec"]["template"]["spec"]["containers"][0]["command"]


def test_multi_node_needs_an_endpoint():
    with pytest.raises(Failure, match="rdzv_endpoint"):
        TorchrunResource(nnodes=2).command(1, Path("job.json"), "cpu")


FAKE_SLURM = {  # just enough of Slurm to run an sbatch script as a one-node allocation on this machine
    "sbatch": """#!/bin/bash
script="${@: -1}"
out=$(sed -n 's/^#SBATCH --output=//p' "$script" | head -n 1)
echo "Submitted batch job 4242"
SLURM_JOB_ID=4242 SLURM_JOB_NODELIST=localhost SLURM_NNODES=1 SLURM_NODEID=0 bash "$script" >> "${out//%j/4242}" 2>&1
""",
    "srun": """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
exec "$@"
""",
    "scontrol": """#!/bin/bash
if [ "$1" = show ] && [ "$2" = job ]; then echo "JobId=4242 JobState=COMPLETED ExitCode=0:0 NodeList=localhost"
else echo localhost; fi
""",
}


@pytest.mark.slow
def test_slurm_launcher_submits_the_script_and_reports_through_pipes(tmp_path, pretrain_job, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in FAKE_SLURM.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    job = json.loads(pretrain_job(tmp_path, max_steps=12, ckpt_interval=6, eval_interval=6, log_interval=6).read_text())
    instance = DagsterInstance.ephemeral()
    result = materialize([launch_asset(job, 1)], instance=instance,
                         resources={"torchrun": TorchrunResource(launcher="slurm", slurm_partition="debug", timeout_s=300)})
    assert result.output_for_node("trained")["steps"] == 12
    run = Path(job["out_dir"])
    script = (run / "launch.sbatch").read_text()
    assert "#SBATCH --partition=debug" in script and f"#SBATCH --output={run / 'train.log'}" in script
    assert "Submitted batch job 4242" in (run / "sbatch.log").read_text()
    assert "step 12/12" in (run / "train.log").read_text()
    assert any("step 12/12" in m for m in user_logs(instance, result.run_id)), "Pipes through the run folder"


def launch_asset(job: dict, nproc: int, retry: RetryPolicy | None = None):
    @asset(retry_policy=retry)
    def trained(context: AssetExecutionContext, torchrun: TorchrunResource) -> Output[dict]:
        return Output(torchrun.launch(context, job, nproc, "cpu"))

    return trained


def user_logs(instance, run_id) -> list[str]:
    return [e.user_message for e in instance.all_logs(run_id) if e.dagster_event is None]


@pytest.mark.slow
def test_two_gloo_processes_through_pipes(tmp_path, pretrain_job):
    job = json.loads(pretrain_job(tmp_path, max_steps=10, eval_interval=5, ckpt_interval=5, log_interval=5).read_text())
    instance = DagsterInstance.ephemeral()
    result = materialize([launch_asset(job, 2)], resources={"torchrun": TorchrunResource(timeout_s=300)},
                         instance=instance)
    value = result.output_for_node("trained")
    assert value["world_size"] == 2 and value["steps"] == 10
    assert value["final_val_loss"] < value["initial_val_loss"] - 0.5
    logs = user_logs(instance, result.run_id)
    assert any("step 10/10" in m for m in logs), "rank 0's progress reaches the Dagster log through Pipes"
    assert (Path(job["out_dir"]) / "train.log").read_text().count("step 10/10") == 1  # rank 0 only


@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_and_a_dagster_retry_resumes_after_a_failure(tmp_path, pretrain_job,
                                                                                        monkeypatch):
    """Rank 0 is SIGKILLed at step 6: torchrun (max_restarts=1) restarts it, it resumes from step 4 and reports
    through Pipes again. At step 9 it raises: no restarts are left, the launch fails naming the worker's error,
    and Dagster's retry relaunches it, which resumes from step 8 and finishes bit-identical to an uninterrupted run,
    goodput accounting for the lost time. The faults come from tests/faults.py,
    run as the workers' module in place of resources.pipes_worker (which it wraps)."""
    from tests.faults import Faults

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # one thread, as the reference below: the same sums in the same order
    monkeypatch.setenv("KILN_FAULTS", str(Faults(kill_at_steps=[6], kill_after_save=True, fail_at_step=9).write(tmp_path / "faults.json")))
    job = json.loads(pretrain_job(tmp_path, max_steps=12, ckpt_interval=4, eval_interval=4, log_interval=4).read_text())
    instance = DagsterInstance.ephemeral()
    result = materialize([launch_asset(job, 1, RetryPolicy(max_retries=1))], instance=instance,
                         resources={"torchrun": TorchrunResource(max_restarts=1, timeout_s=300, worker="tests.faults")})
    value = result.output_for_node("trained")
    assert value["resumed_from"].endswith("step_0000008") and value["steps"] == 12
    good = value["goodput"]  # three sessions: the first, torchrun's restart, Dagster's retry
    assert good["sessions"] == 3 and good["redone_steps_s"] > 0 and good["restarting_s"] > 0 and 0 < good["goodput"] < 1
    parts = ("productive_s", "redone_steps_s", "saving_s", "validation_s", "startup_s", "restarting_s", "other_s")
    assert sum(good[k] for k in parts) == pytest.approx(good["wall_s"], rel=0.01)
    # and the run ends as an uninterrupted one does, bit for bit (weights, optimizer, scheduler, loader, history)
    ref = pretrain_job(tmp_path / "uninterrupted", max_steps=12, ckpt_interval=4, eval_interval=4, log_interval=4)
    with single_thread():  # as the workers: one thread sums matmuls in their order
        main(["--config", str(ref), "--device", "cpu"], reporter=LineReporter())
    assert_same_final_state(ref, Path(job["out_dir"]).parent / "job.json", step=12)
    logs = user_logs(instance, result.run_id)
    assert any("resumed from" in m and m.endswith("at step 4") for m in logs)  # the restarted worker, through Pipes
    assert any("step 12/12" in m for m in logs)
    retries = [e.dagster_event.event_specific_data.error for e in instance.all_logs(result.run_id)
               if e.dagster_event is not None and e.dagster_event.event_type_value == "STEP_UP_FOR_RETRY"]
    assert len(retries) == 1
    failure = retries[0].cause.message if retries[0].cause else retries[0].message
    assert "exited with code" in failure and "injected failure at step 9" in failure and "resumes" in failure


@pytest.mark.slow
def test_launch_is_bounded_in_time(tmp_path, pretrain_job):
    job = json.loads(pretrain_job(tmp_path, max_steps=100000).read_text())
    with pytest.raises(Failure, match="timeout_s=5"):
        materialize([launch_asset(job, 1)], resources={"torchrun": TorchrunResource(timeout_s=5)})


def test_cuda_launch_without_enough_gpus_fails_before_starting_workers(monkeypatch):
    import torch

    from resources.torchrun import check_local_devices

    check_local_devices("cpu", 8)  # nothing to check
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(Failure, match="sees no GPU here.*hardware.device to cpu"):
        check_local_devices("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_local_devices("cuda", 2)
    with pytest.raises(Failure, match="8 ranks per node need 8 GPUs but this machine has 2.*nproc_per_node to at most 2"):
        check_local_devices("cuda", 8)


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and waiting to be reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _wait_until(condition, timeout: float) -> bool:
    deadline = time.time() + timeout
    while not condition() and time.time() < deadline:
        time.sleep(0.05)
    return condition()


# starts a child the way TorchrunResource._run starts torchrun (own session, die_with_parent), from a thread that
# waits for it, as a Dagster step thread does
STARTS_A_CHILD = """
import subprocess, sys, threading, time
from resources.torchrun import die_with_parent

def launch():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                             preexec_fn=die_with_parent())
    print(child.pid, flush=True)
    child.wait()

threading.Thread(target=launch, daemon=True).start()
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_torchrun_dies_with_the_process_that_launched_it_even_in_its_own_session():
    launcher = subprocess.Popen([sys.executable, "-c", STARTS_A_CHILD], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    child = int(launcher.stdout.readline())  # type: ignore[union-attr]
    try:
        time.sleep(0.3)
        assert _running(child) and os.getsid(child) == child  # alive while its launching thread waits on it
        launcher.kill()  # SIGKILL: no handler, no cleanup runs
        launcher.wait(timeout=30)
        assert _wait_until(lambda: not _running(child), timeout=5), "the child outlived its launcher"
    finally:
        if _running(child):
            os.kill(child, signal.SIGKILL)


def test_a_worker_stops_once_its_launcher_or_torchrun_has_ended(monkeypatch):
    from resources.pipes_worker import orphan_reason, watch_for_orphaning

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("KILN_LAUNCHER_PID", raising=False)
    assert watch_for_orphaning(stop=lambda why: None) is None  # not under torchrun, no launcher: nothing to watch
    assert orphan_reason(os.getppid(), os.getpid()) is None
    assert orphan_reason(os.getppid() + 1, None) == f"its torchrun (pid {os.getppid() + 1}) has ended"

    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    monkeypatch.setenv("KILN_LAUNCHER_PID", str(launcher.pid))
    stopped: list[str] = []
    watcher = watch_for_orphaning(interval_s=0.05, stop=stopped.append)
    time.sleep(0.3)
    assert watcher is not None and watcher.is_alive() and stopped == []
    launcher.kill()  # not reaped yet: a zombie counts as ended
    assert _wait_until(lambda: bool(stopped), timeout=5)
    watcher.join(timeout=5)
    assert stopped == [f"the process that launched the job (pid {launcher.pid}) has ended"]
    launcher.wait(timeout=30)
    assert orphan_reason(None, launcher.pid) is not None


def test_the_root_cause_is_the_workers_last_exception_line():
    from resources.torchrun import root_cause

    lines = ["[rank0]: Traceback (most recent call last):\n", '  File "x.py", line 3, in <module>\n',
             "RuntimeError: injected failure at step 3\n",
             "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"]
    assert root_cause(lines) == "Worker error: RuntimeError: injected failure at step 3"
    assert root_cause(["no exception here\n"]).startswith("Last lines:\nno exception here")


def test_slurm_job_state_is_parsed_from_scontrol(tmp_path, monkeypatch):
    from resources.torchrun import slurm_job

    (tmp_path / "scontrol").write_text("#!/bin/bash\necho 'JobId=7 JobName=kiln-x JobState=CANCELLED Reason=None "
                                       "ExitCode=0:15 RunTime=00:00:12 NodeList=localhost'\n")
    (tmp_path / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    info = slurm_job("7")
    assert info["JobState"] == "CANCELLED" and info["ExitCode"] == "0:15" and info["NodeList"] == "localhost"


@pytest.mark.slow
def test_a_preempted_launch_is_retried_and_resumes_from_the_step_it_saved(tmp_path, pretrain_job, monkeypatch):
    """torchrun gets SIGTERM mid-run (a node preempted) and passes it on: the worker saves its step and exits 75; the
    launch reports Preempted (Dagster: up for retry, MLflow: KILLED), and the retry resumes from that step."""
    from resources.torchrun import descendants

    job = json.loads(pretrain_job(tmp_path, max_steps=40, ckpt_interval=100, eval_interval=20, log_interval=1).read_text())
    out = Path(job["out_dir"])

    def preempt() -> None:  # SIGTERM torchrun itself once the run is past step 12
        deadline = time.time() + 120
        while time.time() < deadline:
            log = out / "train.log"
            if log.exists() and "step 12/40" in log.read_text():
                for pid in descendants(os.getpid()):
                    try:
                        if b"torch.distributed.run" in Path(f"/proc/{pid}/cmdline").read_bytes():
                            os.kill(pid, signal.SIGTERM)
                            return
                    except OSError:
                        continue
            time.sleep(0.05)

    import threading

    threading.Thread(target=preempt, daemon=True).start()
    instance = DagsterInstance.ephemeral()
    result = materialize([launch_asset(job, 1)], instance=instance,
                         resources={"torchrun": TorchrunResource(timeout_s=300, preempt_retry_wait_s=0.5)})
    value = result.output_for_node("trained")
    from kiln.train.logbook import attempts

    rows = attempts(out)
    assert [r["outcome"] for r in rows] == ["preempted", "completed"], rows
    saved = rows[0]["to_step"]
    assert saved >= 12 and rows[0]["steps_lost"] == 0 and rows[0]["note"] == "SIGTERM"
    assert value["steps"] == 40 and value["resumed_from"].endswith(f"step_{saved:07d}")  # no periodic save before 40
    events = [e.dagster_event for e in instance.all_logs(result.run_id) if e.dagster_event is not None]
    retries = [e for e in events if e.event_type_value == "STEP_UP_FOR_RETRY"]
    assert len(retries) == 1 and not [e for e in events if e.event_type_value == "STEP_FAILURE"]


@pytest.mark.slow
def test_ctrl_c_stops_the_launch_with_its_step_saved_and_no_retry(tmp_path, pretrain_job):
    """SIGINT to the process running Dagster (Ctrl-C in `kiln run`) mid-training: the workers save the step they
    reached and stop, and the step fails once as Stopped even though the asset has base_model's retry policy (Dagster
    turns an interrupted step with a retry policy into a retry, so the run would go on); the next materialization
    resumes from the saved step."""
    from assets.training import TRAINING_RETRY
    from kiln.train.logbook import attempts
    from resources.torchrun import Stopped

    job = json.loads(pretrain_job(tmp_path, max_steps=400, ckpt_interval=1000, eval_interval=1000,
                                  log_interval=1).read_text())
    out = Path(job["out_dir"])

    def interrupt() -> None:  # Ctrl-C once the run is past step 12 (long before its end at step 400)
        deadline = time.time() + 120
        while time.time() < deadline:
            log = out / "train.log"
            if log.exists() and "step 12/400" in log.read_text():
                os.kill(os.getpid(), signal.SIGINT)  # Dagster's handler turns it into an interrupt of the step
                return
            time.sleep(0.05)

    import threading

    threading.Thread(target=interrupt, daemon=True).start()
    instance = DagsterInstance.ephemeral()
    result = materialize([launch_asset(job, 1, TRAINING_RETRY)], instance=instance, raise_on_error=False,
                         resources={"torchrun": TorchrunResource(timeout_s=300)})
    assert not result.success
    events = [e.dagster_event for e in instance.all_logs(result.run_id) if e.dagster_event is not None]
    assert not [e for e in events if e.event_type_value == "STEP_UP_FOR_RETRY"]
    failure = next(e for e in events if e.event_type_value == "STEP_FAILURE").step_failure_data.error
    assert failure.cls_name == Stopped.__name__, failure
    rows = attempts(out)
    saved = rows[0]["to_step"]
    assert [r["outcome"] for r in rows] == ["preempted"] and 12 <= saved < 400 and rows[0]["steps_lost"] == 0
    assert f"step {saved} saved; not retried. Materialize again to resume" in failure.message
    assert (out / "checkpoints" / f"step_{saved:07d}").is_dir()


@pytest.mark.slow
def test_a_full_disk_stops_the_launch_at_once_naming_the_path(tmp_path, pretrain_job, monkeypatch):
    """Every checkpoint write from step 8 on fails with ENOSPC (tests/faults.py; a failed write names no file):
    the worker asks the launcher to stop the job, so torchrun (max_restarts=1) does not restart it and base_model's
    retry policy does not run it again; the one failure names the folder that could not be written, the free space
    there and what to do."""
    from assets.training import TRAINING_RETRY
    from kiln.train.checkpoint import list_checkpoints
    from kiln.train.logbook import attempts
    from tests.faults import Faults

    monkeypatch.setenv("KILN_FAULTS", str(Faults(no_space_from_step=8).write(tmp_path / "faults.json")))
    job = json.loads(pretrain_job(tmp_path, max_steps=12, ckpt_interval=4, eval_interval=4, log_interval=4).read_text())
    instance = DagsterInstance.ephemeral()
    result = materialize([launch_asset(job, 1, TRAINING_RETRY)], instance=instance, raise_on_error=False,
                         resources={"torchrun": TorchrunResource(max_restarts=1, timeout_s=300, worker="tests.faults")})
    assert not result.success
    out = Path(job["out_dir"])
    rows = attempts(out)
    assert [(r["attempt"], r["outcome"]) for r in rows] == [("1.0", "crashed")], rows  # no restart, no relaunch
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_0000004"]  # where the next run resumes
    events = [e.dagster_event for e in instance.all_logs(result.run_id) if e.dagster_event is not None]
    assert not [e for e in events if e.event_type_value == "STEP_UP_FOR_RETRY"]
    failures = [e.event_specific_data.error for e in events if e.event_type_value == "STEP_FAILURE"]
    assert len(failures) == 1
    message = failures[0].cause.message if failures[0].cause else failures[0].message
    written = out / "checkpoints" / ".step_0000008.partial"
    assert f"No space left on device (ENOSPC) writing {written} (" in message
    assert " free of " in message and "on that filesystem" in message
    assert "storage root" in message and "training resumes from the newest good checkpoint" in message


@pytest.mark.slow
def test_a_new_code_version_trains_afresh_instead_of_resuming_the_old_codes_finished_run(tmp_path, pretrain_job):
    """The same job under the same code version is reused; under a new code version it is neither reused nor resumed
    from the old code's run folder (whose final checkpoint would otherwise be found finished and returned)."""
    from resources.storage import KilnStorageResource
    from resources.tracking import MlflowResource
    from tests.resources.test_slurm import training_asset

    job = json.loads(pretrain_job(tmp_path, max_steps=6, ckpt_interval=3, eval_interval=6, log_interval=3).read_text())
    res = {"torchrun": TorchrunResource(timeout_s=300), "storage": KilnStorageResource(root=str(tmp_path / "storage")),
           "mlflow": MlflowResource(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                                    artifact_root=str(tmp_path / "mlartifacts"))}
    instance = DagsterInstance.ephemeral()
    first = materialize([training_asset(job, "1")], resources=res, instance=instance).output_for_node("trained")
    again = materialize([training_asset(job, "1")], resources=res, instance=instance).output_for_node("trained")
    new = materialize([training_asset(job, "2")], resources=res, instance=instance).output_for_node("trained")
    assert first["steps"] == 6 and first["resumed_from"] is None
    assert again["out_dir"] == first["out_dir"] and again["mlflow_run_id"] == first["mlflow_run_id"]  # reused
    assert new["out_dir"] != first["out_dir"] and new["mlflow_run_id"] != first["mlflow_run_id"]
    assert new["resumed_from"] is None and new["steps"] == 6  # trained all six steps again, from its own folder
    assert Path(first["checkpoint"]).is_dir()  # the old code's run is left where it was
