"""The llama-tiny preset through Dagster: its training_plan and base_model assets (a real torchrun job) on tiny
inputs, then its checkpoint released and loaded by transformers as a LlamaForCausalLM with Kiln's logits."""

from pathlib import Path

import pytest
import torch
from dagster import DagsterInstance, asset, materialize

from assets.training import base_model, training_plan
from jobs.cli import load_preset
from kiln.release.bundle import write_release
from kiln.shards import shard_paths
from kiln.train.checkpoint import load_for_inference
from resources.storage import KilnStorageResource
from resources.torchrun import TorchrunResource
from resources.tracking import MlflowResource


@pytest.mark.slow
def test_llama_tiny_preset_plans_trains_and_releases_for_transformers(tmp_path, tiny_tokenizer, tiny_shards):
    import transformers

    enc, tok_path = tiny_tokenizer
    ops = load_preset("llama-tiny")["ops"]
    config = {"ops": {name: ops[name] for name in ("training_plan", "base_model")}}
    config["ops"]["training_plan"]["config"]["batch"]["max_steps"] = 20  # a third of the preset's 60, for time

    @asset(name="token_shards")
    def shards_stub() -> dict:
        return {"train": [str(p) for p in shard_paths(tiny_shards, "train")],
                "val": [str(p) for p in shard_paths(tiny_shards, "val")], "version": "shards-v1",
                "totals": {"train": {"tokens": 100_000}}}

    @asset(name="tokenizer")
    def tokenizer_stub() -> dict:
        return {"path": str(tok_path), "version": "tok-v1", "n_vocab": enc.n_vocab}

    @asset(name="pretrained_model")
    def pretrained_stub() -> dict:
        return {"path": "", "version": "none"}  # from scratch

    mlflow = MlflowResource(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=str(tmp_path / "art"))
    result = materialize([pretrained_stub, shards_stub, tokenizer_stub, training_plan, base_model], run_config=config,
                         instance=DagsterInstance.ephemeral(),
                         resources={"storage": KilnStorageResource(root=str(tmp_path / "storage")), "mlflow": mlflow,
                                    "torchrun": TorchrunResource(timeout_s=300)})
    plan = result.output_for_node("training_plan")
    assert {k: plan["model"][k] for k in ("family", "n_layer", "n_head", "n_kv_head", "n_embd", "block_size")} == {
        "family": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64, "block_size": 64}
    value = result.output_for_node("base_model")
    assert value["steps"] == plan["max_steps"] == 20
    assert value["final_val_loss"] < value["initial_val_loss"] - 0.3

    write_release(value["checkpoint"], tmp_path / "release", card="# llama-tiny\n")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "release").eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.num_key_value_heads == 2
    kiln_model, _, _ = load_for_inference(value["checkpoint"])
    idx = torch.randint(0, enc.n_vocab, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = kiln_model(idx), hf(idx).logits  # (B, T, vocab)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
