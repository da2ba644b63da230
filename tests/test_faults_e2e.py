"""Faults across the whole launch: the process running a Dagster step is SIGKILLed while torchrun trains under it;
nothing it started may live on, and the same materialization afterwards resumes to bit-identical weights.

Run: python -m pytest tests/test_faults_e2e.py -q   (tiny model on CPU; marked slow, about 20-30 s)
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from dagster import AssetExecutionContext, Output, asset, materialize

from resources.torchrun import TorchrunResource
from tests.conftest import subprocess_env
from tests.faults import Faults

ROOT = Path(__file__).resolve().parent.parent
MARKER = "KILN_TEST_LAUNCH"  # set in the killed process's environment, so inherited by all it starts

# One Dagster step that launches ``job`` through the real TorchrunResource, as a ``kiln run`` step does; the workers
# run tests/faults.py (slowed down) in place of resources/pipes_worker.py, which it wraps.
LAUNCH = """
import json, sys
from dagster import AssetExecutionContext, Output, asset, materialize
from resources.torchrun import TorchrunResource

job = json.loads(open(sys.argv[1]).read())

@asset
def trained(context: AssetExecutionContext, torchrun: TorchrunResource) -> Output[dict]:
    return Output(torchrun.launch(context, job, 1, "cpu"))

materialize([trained], resources={"torchrun": TorchrunResource(timeout_s=300, worker="tests.faults")})
"""


def launch_asset(job: dict):
    @asset
    def trained(context: AssetExecutionContext, torchrun: TorchrunResource) -> Output[dict]:
        return Output(torchrun.launch(context, job, 1, "cpu"))

    return trained


def marked(marker: str) -> dict[int, str]:
    """{pid: command line} of every live process whose environment holds ``MARKER=marker``."""
    needle = f"{MARKER}={marker}".encode()
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0"):
                found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return found


def wait_for(condition, timeout: float, every: float = 0.05) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return True
        time.sleep(every)
    return condition()


def job_file(pretrain_job, folder: Path) -> Path:
    """100 steps, a checkpoint every 25; progress and validation lines only at the end."""
    return pretrain_job(folder, max_steps=100, ckpt_interval=25, keep_last=10, eval_interval=1000, log_interval=1000)


def final_weights(job: Path) -> tuple[str, list]:
    """(weights digest of the last checkpoint, validation history) of a finished job."""
    run = Path(json.loads(job.read_text())["out_dir"])
    result = json.loads((run / "result.json").read_text())
    meta = json.loads((Path(result["checkpoint"]) / "meta.json").read_text())
    return meta["weights_digest"], result["history"]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the launched processes through /proc")
def test_a_killed_launcher_leaves_no_torchrun_or_worker_and_a_rerun_resumes_bit_identically(
        tmp_path, pretrain_job, train_runner, monkeypatch):
    job = job_file(pretrain_job, tmp_path / "killed")
    run = Path(json.loads(job.read_text())["out_dir"])
    marker = uuid.uuid4().hex
    faults = Faults(step_sleep_s=0.03).write(tmp_path / "faults.json")
    env = {**subprocess_env(), MARKER: marker, "KILN_FAULTS": str(faults)}
    with open(tmp_path / "launcher.log", "w") as log:
        leader = subprocess.Popen([sys.executable, "-c", LAUNCH, str(job)], cwd=ROOT, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        started = wait_for(lambda: (run / "checkpoints" / "step_0000025" / "meta.json").exists(), timeout=180)
        assert started, (tmp_path / "launcher.log").read_text()[-3000:]
        tree = marked(marker)
        assert any("torch.distributed.run" in c for c in tree.values()), tree
        assert any("tests.faults" in c and "torch.distributed.run" not in c for c in tree.values()), tree
        os.kill(leader.pid, signal.SIGKILL)  # the step's process crashes; its process group is left alone
        assert leader.wait(timeout=30) == -signal.SIGKILL
        t0 = time.time()
        gone = wait_for(lambda: not marked(marker), timeout=3.0)
        assert gone, f"still running {time.time() - t0:.1f}s after the launcher was killed: {marked(marker)}"
        print(f"\nthe launch ended {time.time() - t0:.2f}s after its launcher was killed")
    finally:
        for pid in marked(marker):  # what the launch left behind, so no later test trains beside it
            os.kill(pid, signal.SIGKILL)
    assert not (run / "result.json").exists()  # the job did not finish

    # the same launch again (no faults) resumes from the newest good checkpoint and ends where an uninterrupted run
    # does, to the bit
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as the uninterrupted run's
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    result = materialize([launch_asset(json.loads(job.read_text()))], resources={"torchrun": TorchrunResource(timeout_s=300)})
    value = result.output_for_node("trained")
    assert value["steps"] == 100 and value["resumed_from"], value.get("resumed_from")
    assert 25 <= int(Path(value["resumed_from"]).name.split("_")[1]) < 100
    reference = job_file(pretrain_job, tmp_path / "uninterrupted")
    done = train_runner(reference)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert final_weights(job) == final_weights(reference)
