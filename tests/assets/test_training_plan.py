"""The training_plan asset, invoked directly: real plan values, and config errors that name the key."""

import pytest
from dagster import build_asset_context

from assets.training import TrainingPlanConfig, training_plan
from kiln.config import ConfigError
from kiln.plan import PlanError
from resources.tracking import MlflowResource

TOKENIZER = {"n_vocab": 4099}
SHARDS = {"totals": {"train": {"tokens": 1_000_000}}}


def run(tmp_path, **config):
    mlflow = MlflowResource(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=str(tmp_path / "art"))
    with build_asset_context(resources={"mlflow": mlflow}) as ctx:
        return training_plan(ctx, TrainingPlanConfig(**config), tokenizer=TOKENIZER, token_shards=SHARDS)


def test_plan_from_config(tmp_path):
    out = run(tmp_path, model={"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64},
              batch={"seq_len": 64, "global_batch": 8, "max_steps": 10}, hardware={"nproc_per_node": 2})
    plan = out.value
    assert plan["model"]["vocab_size"] == 4160  # 4099 padded to a multiple of 64
    assert plan["world_size"] == 2 and plan["parallelism"] == "ddp"
    assert plan["micro_batch"] * plan["grad_accum"] * 2 == 8
    assert plan["total_tokens"] == 8 * 64 * 10
    assert out.metadata["parameters"].value == plan["params"]


def test_unknown_model_key_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"training_plan\.model: unknown key 'n_layers'.*Did you mean 'n_layer'"):
        run(tmp_path, model={"n_layers": 2})


def test_plan_that_cannot_fit_says_what_would(tmp_path):
    with pytest.raises(PlanError, match="GiB"):
        run(tmp_path, hardware={"memory_gb": 0.01})
