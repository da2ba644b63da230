"""The base_model asset, materialized through Dagster on tiny inputs: the torchrun job, its metadata (loss curve,
checkpoints, goodput, throughput), its MLflow run, and its retry policy."""

import json
from pathlib import Path

import pytest
from dagster import AssetKey, Backoff, DagsterInstance, asset, materialize
from mlflow.tracking import MlflowClient

from assets.training import base_model
from kiln.model.parallel import MeshLayout
from kiln.model.pipeline_parallel import PipelineConfig
from kiln.train.checkpoint import checkpoint_identity
from kiln.train.job import JobConfig, load_job
from kiln.plan.memory import BatchConfig, HardwareConfig, make_plan
from kiln.model.config import ModelConfig
from kiln.tokens.shards import shard_paths
from resources.storage import KilnStorageResource
from resources.torchrun import TorchrunResource
from resources.tracking import MlflowResource


SPLITS = {  # a plan's layout on two torchrun ranks, one data-parallel rank: the fields the plan carries
    "tp2": {"layout": {"dp_replicate": 1, "dp_shard": 1, "tp": 2, "pp": 1}},  # each layer split over both
    "pp2": {"layout": {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 2}, "micro_batch": 2, "grad_accum": 2,
            "pipeline": {"schedule": "1f1b", "virtual_stages": 1, "microbatches": 0}},  # a block per rank
}


@pytest.mark.slow
@pytest.mark.parametrize("split", list(SPLITS))
def test_base_model_trains_and_shows_checkpoints_goodput_and_curves(tmp_path, tiny_tokenizer, tiny_shards, model_dict,
                                                                   split):
    """On two torchrun ranks splitting the model (a plan's tensor-parallel or pipeline layout, one data-parallel
    rank); the smoke pipeline materializes base_model on one process."""
    _, tok_path = tiny_tokenizer
    plan = make_plan(ModelConfig(**model_dict), BatchConfig(seq_len=32, global_batch=4, max_steps=12),
                     HardwareConfig(memory_gb=4)).to_dict()
    plan.update(hardware={"device": "cpu", "nproc_per_node": 2, "nnodes": 1, "peak_tflops": None}, max_steps=12,
                world_size=2, **SPLITS[split])

    @asset(name="training_plan")
    def plan_stub() -> dict:
        return plan

    @asset(name="token_shards")
    def shards_stub() -> dict:
        return {"train": [str(p) for p in shard_paths(tiny_shards, "train")],
                "val": [str(p) for p in shard_paths(tiny_shards, "val")], "version": "shards-v1"}

    @asset(name="tokenizer")
    def tokenizer_stub() -> dict:
        return {"path": str(tok_path), "version": "tok-v1"}

    mlflow = MlflowResource(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=str(tmp_path / "art"))
    config = {"ops": {"base_model": {"config": {"eval_interval": 6, "eval_batches": 2, "ckpt_interval": 4, "keep_last": 1,
                                                "keep_every": 8, "log_interval": 6, "optim": {"warmup_steps": 2}}}}}
    instance = DagsterInstance.ephemeral()
    result = materialize([plan_stub, shards_stub, tokenizer_stub, base_model], run_config=config, instance=instance,
                         resources={"storage": KilnStorageResource(root=str(tmp_path / "storage")), "mlflow": mlflow,
                                    "torchrun": TorchrunResource(timeout_s=300)})
    value = result.output_for_node("base_model")
    assert value["steps"] == 12 and value["final_val_loss"] < value["initial_val_loss"]
    assert [c["step"] for c in value["checkpoints"]] == [8, 12]  # the newest plus every 8th
    assert value["version"] == checkpoint_identity(Path(value["checkpoint"]))

    mat = instance.get_latest_materialization_event(AssetKey("base_model")).asset_materialization
    meta = mat.metadata
    assert meta["loss_curve"].value.startswith("![pretrain loss](data:image/png;base64,")
    assert "| 8 |" in meta["checkpoints"].value and "| 12 |" in meta["checkpoints"].value
    assert 0 < meta["goodput"].value < 1 and "| productive |" in meta["goodput_breakdown"].value
    assert meta["tokens_per_s"].value > 0 and 0 < meta["mfu"].value < 1 and meta["parallelism"].value == "none"
    layout = SPLITS[split]["layout"]
    assert meta["layout"].value == {"tp2": "dp_replicate 1 x dp_shard 1 x tp 2",
                                    "pp2": "pp 2 x dp_replicate 1 x dp_shard 1 x tp 1"}[split]
    assert meta["world_size"].value == 2
    assert str(mat.tags.get("dagster/data_version", value["version"])) == value["version"]

    client = MlflowClient(mlflow.resolved_uri())
    run = client.get_run(value["mlflow_run_id"])
    for name in ("train_loss", "val_loss", "grad_norm", "lr", "tokens_per_s", "mfu", "memory_gb", "system/kiln.goodput",
                 "system/kiln.cost.device_hours", "system/kiln.cost.cost"):
        assert name in run.data.metrics, name
    # The run page's Model metrics tab (every key outside "system/", charts sorted by name) holds the curves only:
    # no one-off cost or goodput bar sorts before train_loss.
    assert sorted(k for k in run.data.metrics if not k.startswith("system/")) == [
        "grad_norm", "lr", "memory_gb", "mfu", "step_time_s", "tokens_per_s", "train_loss", "val_loss"]
    assert "loss.png" in [a.path for a in client.list_artifacts(run.info.run_id)]
    # rank 0 spooled its records and the launcher sent them all (kiln.common.metrics.SpoolForwarder), sampling the
    # machine's system metrics into the run itself
    spool = Path(value["out_dir"]) / "tracking.jsonl"
    assert int((Path(value["out_dir"]) / "tracking.jsonl.sent").read_text()) == spool.stat().st_size > 0
    assert "system/cpu_utilization_percentage" in run.data.metrics
    assert client.get_run(run.info.run_id).data.params["job.max_steps"] == "12"
    job = load_job(JobConfig, json.loads((Path(value["out_dir"]) / "job.json").read_text()))  # the job it ran
    assert job.keep_every == 8 and job.async_save and job.parallelism == "none"
    assert job.layout == MeshLayout(**layout)
    assert job.pipeline == PipelineConfig(**SPLITS[split].get("pipeline", {}))


def test_base_model_retries_a_failed_launch_twice_with_growing_delays():
    """A retried launch resumes from the newest good checkpoint (tests/resources/test_torchrun.py shows it with this
    policy); here, the policy base_model runs under, by its values."""
    policy = base_model.op.retry_policy
    assert (policy.max_retries, policy.delay, policy.backoff) == (2, 5, Backoff.EXPONENTIAL)


def test_base_model_fails_at_once_on_a_config_error(tmp_path):
    """A job the workers could not build fails before launch, once, naming the key: kiln.train.job.load_job checks
    the job file's fields in the resource (n_embd 65 does not split into 2 heads), so no retry is spent on it."""
    def stub(name, value):
        return asset(name=name)(lambda: value)

    plan = {"model": {"n_layer": 1, "n_head": 2, "n_embd": 65, "vocab_size": 64, "block_size": 16}, "seq_len": 16,
            "micro_batch": 2, "grad_accum": 1, "max_steps": 4, "hardware": {"device": "cpu", "nproc_per_node": 1}}
    stubs = [stub(n, v) for n, v in (
        ("training_plan", plan), ("token_shards", {"train": [], "val": [], "version": "s1"}),
        ("tokenizer", {"path": "t.json", "version": "t1"}))]
    result = materialize([*stubs, base_model], raise_on_error=False,
                         resources={"storage": KilnStorageResource(root=str(tmp_path / "storage")), "torchrun": TorchrunResource(),
                                    "mlflow": MlflowResource(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                                                             artifact_root=str(tmp_path / "art"))})
    assert not result.success
    events = [ev for ev in result.all_events if ev.step_key == "base_model"]
    assert not [ev for ev in events if ev.event_type_value == "STEP_UP_FOR_RETRY"]
    failure = [ev for ev in events if ev.is_step_failure][0].event_specific_data.error
    assert "base_model: model.n_embd (65) must be divisible by model.n_head (2)" in failure.message
    assert not (tmp_path / "storage" / "base_model").exists()  # nothing was launched


def test_the_demo_trains_with_the_recipe_the_speedrun_bench_races():
    """bench/speedrun.py's ``default`` is kiln.train.recipe.demo_recipe(); the demo preset and the asset defaults
    must be that recipe, or the bench measures something the demo does not run."""
    from assets.training import BaseModelConfig, TrainingPlanConfig
    from jobs.presets import load_preset
    from kiln.train.recipe import demo_recipe

    recipe = demo_recipe()
    optim = BaseModelConfig().optim.to_dict()
    assert {k: optim[k] for k in recipe["optim"]} == recipe["optim"]
    plan_ops = load_preset("demo")["ops"]["training_plan"]["config"]
    cfg = TrainingPlanConfig(**plan_ops)
    planned = cfg.planned(4096)
    model, batch = planned.model, planned.batch
    assert {k: getattr(model, k) for k in recipe["model"]} == recipe["model"]
    assert (batch.seq_len, batch.global_batch, batch.max_steps) == (
        recipe["seq_len"], recipe["micro_batch"], recipe["max_steps"])
    assert bool(planned.record().cpu_bf16) is recipe["cpu_bf16"]  # bf16 autocast in both or in neither
