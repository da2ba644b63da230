"""The torchrun launcher: exact command lines, a two-process gloo job through Pipes, timeouts and failures."""

import json
from pathlib import Path

import pytest
from dagster import AssetExecutionContext, DagsterInstance, Failure, Output, asset, materialize

from resources.torchrun import TorchrunResource

TAIL = ["-m", "resources.pipes_worker", "--config", "/runs/a/job.json", "--device", "cpu", "--timeout-s", "600"]


def test_single_node_command():
    cmd = TorchrunResource().command(2, Path("/runs/a/job.json"), "cpu", "run1")
    assert cmd[1:] == ["-m", "torch.distributed.run", "--nproc_per_node=2", "--max_restarts=0", "--standalone", *TAIL]


def test_multi_node_command_uses_c10d_rendezvous():
    res = TorchrunResource(nnodes=2, node_rank=1, rdzv_endpoint="node0:29500", max_restarts=3)
    cmd = res.command(8, Path("/runs/a/job.json"), "cpu", "run1")
    assert cmd[3:10] == ["--nproc_per_node=8", "--max_restarts=3", "--nnodes=2", "--node_rank=1",
                         "--rdzv_backend=c10d", "--rdzv_endpoint=node0:29500", "--rdzv_id=run1"]
    assert "--standalone" not in cmd


def test_multi_node_needs_an_endpoint():
    with pytest.raises(Failure, match="rdzv_endpoint"):
        TorchrunResource(nnodes=2).command(1, Path("job.json"), "cpu")


def launch_asset(job: dict, nproc: int):
    @asset
    def trained(context: AssetExecutionContext, torchrun: TorchrunResource) -> Output[dict]:
        return Output(torchrun.launch(context, job, nproc, "cpu"))

    return trained


@pytest.mark.slow
def test_two_gloo_processes_through_pipes(tmp_path, pretrain_job):
    job = json.loads(pretrain_job(tmp_path).read_text())
    instance = DagsterInstance.ephemeral()
    result = materialize([launch_asset(job, 2)], resources={"torchrun": TorchrunResource(timeout_s=300)},
                         instance=instance)
    value = result.output_for_node("trained")
    assert value["world_size"] == 2 and value["steps"] == 30
    assert value["final_val_loss"] < value["initial_val_loss"] - 0.5
    logs = [e.user_message for e in instance.all_logs(result.run_id) if e.dagster_event is None]
    assert any("step 30/30" in m for m in logs), "rank 0's progress reaches the Dagster log through Pipes"
    assert (Path(job["out_dir"]) / "train.log").read_text().count("step 30/30") == 1  # rank 0 only


@pytest.mark.slow
def test_worker_failure_names_the_log_and_resume(tmp_path, pretrain_job):
    job = json.loads(pretrain_job(tmp_path, fail_at_step=15).read_text())
    with pytest.raises(Failure, match=r"(?s)exited with code .*injected failure at step 15.*resumes"):
        materialize([launch_asset(job, 1)], resources={"torchrun": TorchrunResource(timeout_s=300)})
    result = materialize([launch_asset(job, 1)], resources={"torchrun": TorchrunResource(timeout_s=300)})
    assert result.output_for_node("trained")["resumed_from"].endswith("step_0000010")


@pytest.mark.slow
def test_launch_is_bounded_in_time(tmp_path, pretrain_job):
    job = json.loads(pretrain_job(tmp_path, max_steps=100000).read_text())
    with pytest.raises(Failure, match="timeout_s=5"):
        materialize([launch_asset(job, 1)], resources={"torchrun": TorchrunResource(timeout_s=5)})
