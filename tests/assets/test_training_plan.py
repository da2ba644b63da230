"""The training_plan asset, invoked directly: real plan values, named model sizes, the parallelism choice, and
config errors that name the key."""

import pytest
from dagster import DagsterInvalidConfigError, build_asset_context

from assets.training import TrainingPlanConfig, training_plan
from kiln.plan.memory import PlanError
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
    assert plan["world_size"] == 2 and plan["parallelism"] == "ddp" and not plan["activation_checkpointing"]
    assert plan["micro_batch"] * plan["grad_accum"] * 2 == 8
    assert plan["total_tokens"] == 8 * 64 * 10
    meta = out.metadata
    assert meta["parameters"].value == plan["params"]
    assert meta["parallelism"].value == "ddp" and "ddp fits" in meta["why"].value
    assert "| ddp |" in meta["options_considered"].value and "| fsdp |" in meta["options_considered"].value
    assert meta["tokens_per_parameter"].value == pytest.approx(plan["total_tokens"] / plan["params"], abs=1e-3)
    assert meta["estimated_flops"].value == plan["total_flops"] and meta["estimated_hours"].value > 0


def test_named_model_size_on_gpus_chooses_fsdp_when_replicas_do_not_fit(tmp_path):
    out = run(tmp_path, model_preset="gpt2-large", batch={"seq_len": 1024, "global_batch": 64, "max_steps": 10},
              hardware={"device": "cuda", "nproc_per_node": 8, "memory_gb": 16, "peak_tflops": 312.0})
    plan = out.value
    assert (plan["model"]["n_layer"], plan["model"]["n_embd"], plan["model"]["vocab_size"]) == (36, 1280, 4160)
    assert plan["parallelism"] == "fsdp" and plan["activation_checkpointing"]
    assert plan["peak_tflops"] == 312.0


def test_unknown_model_key_is_named(tmp_path):
    with pytest.raises(DagsterInvalidConfigError, match=r'unexpected config entry "n_layers" at path root:config:model\. '
                                                         r'Expected: "\{.* n_layer\?'):
        run(tmp_path, model={"n_layers": 2})
    with pytest.raises(DagsterInvalidConfigError, match=r'unexpected config entry "strategies" at path root:config:parallel'):
        run(tmp_path, parallel={"strategies": "fsdp"})


def test_plan_that_cannot_fit_says_what_would(tmp_path):
    from dagster import Failure

    with pytest.raises(Failure, match="PlanError: .*GiB") as err:  # a plan error is final: not retried
        run(tmp_path, hardware={"memory_gb": 0.01})
    assert isinstance(err.value.__cause__, PlanError) and err.value.allow_retries is False


def test_model_schema_shows_every_family_field_with_its_doc():
    from assets.training import ModelOverrides
    from kiln.common.config import field_docs
    from kiln.model.config import ModelConfig

    fields = ModelOverrides.model_fields
    docs = field_docs(ModelConfig)
    assert set(fields) == set(docs) >= {"family", "n_kv_head", "intermediate_size", "rope_theta", "qk_norm", "tie_embeddings"}
    for name, f in fields.items():
        assert f.description == docs[name] and f.description, name
    assert "llama" in fields["family"].description and "llama" in TrainingPlanConfig.model_fields["model_preset"].description


def test_llama_family_picks_its_named_size_and_wrong_fields_fail_as_config_errors(tmp_path):
    from dagster import Failure

    from kiln.common.config import ConfigError

    plan = run(tmp_path, model_preset="tiny", model={"family": "llama"},
               batch={"seq_len": 64, "global_batch": 8, "max_steps": 10}).value
    assert {k: plan["model"][k] for k in ("family", "n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size")} == {
        "family": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64, "intermediate_size": 192}
    assert "bias" not in plan["model"] and plan["params"] == 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 192 + 128) + 64 + 4160 * 64
    with pytest.raises(Failure, match="ConfigError: training_plan: model.n_kv_head applies to the llama and moe families only") as err:
        run(tmp_path, model_preset="tiny", model={"n_kv_head": 2})
    assert isinstance(err.value.__cause__, ConfigError) and err.value.allow_retries is False
    with pytest.raises(Failure, match="unknown model preset 'gpt2-large' for family llama"):
        run(tmp_path, model_preset="gpt2-large", model={"family": "llama"})


def test_the_llama_tiny_preset_plans_the_tiny_llama(tmp_path):
    """The llama-tiny preset (CI for the second family) plans the llama family's tiny size with 2 key/value heads. A
    llama trained through base_model and released for transformers: tests/test_e2e_pretrained.py; from scratch, on
    one and two processes: tests/kiln/train/test_train_llama.py."""
    from jobs.presets import load_preset

    plan = run(tmp_path, **load_preset("llama-tiny")["ops"]["training_plan"]["config"]).value
    assert {k: plan["model"][k] for k in ("family", "n_layer", "n_head", "n_kv_head", "n_embd", "block_size")} == {
        "family": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64, "block_size": 64}
    assert plan["max_steps"] == 60 and plan["seq_len"] == 64 and plan["micro_batch"] * plan["grad_accum"] == 16


def test_a_ladders_prediction_is_shown_with_its_interval_and_the_laws_optimal_size_when_there_is_one():
    from assets.training import prediction_metadata

    scaling = {"ladder": "abc123", "predicted_val_loss": 3.456789, "interval": [3.4, 3.51234],
               "optimal": {"params": 1.5e6, "tokens": 3.2e7}}
    assert prediction_metadata(scaling) == {
        "predicted_val_loss": 3.4568, "predicted_val_loss_interval": "3.4000 .. 3.5123",
        "predicted_by": "scaling_ladder abc123", "law_optimal_params": 1_500_000, "law_optimal_tokens": 32_000_000}
    failed = prediction_metadata({**scaling, "optimal": {"error": "beta <= 0"}})
    assert "law_optimal_params" not in failed and failed["predicted_by"] == "scaling_ladder abc123"
