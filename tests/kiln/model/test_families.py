"""A new model family is one file plus one registry line: the demonstration family (tests/kiln/model/qwen2_family.py,
Llama with q/k/v biases) trains, plans, checkpoints, releases to transformers' Qwen2ForCausalLM with Kiln's logits
and imports back, with nothing else changed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.model import families
from kiln.model.config import ModelConfig
from kiln.model.config import model_dict as serialised
from kiln.model.lora import LoRAConfig, apply_lora

QWEN2 = {"family": "qwen2", "block_size": 32, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 48,
         "tie_embeddings": False}


@pytest.fixture
def qwen2(monkeypatch):
    monkeypatch.setitem(families.FAMILY_MODULES, "qwen2", "tests.kiln.model.qwen2_family")  # the one registry line


def test_every_family_names_its_own_layers_and_counts_its_own_parameters():
    for name in families.names():
        desc = families.family(name)
        cfg = ModelConfig(**({"family": name} if name != "gpt2" else {}), n_layer=2, n_head=4, n_embd=64, vocab_size=128)
        model = desc.model(cfg)
        params = dict(model.named_parameters())
        assert desc.parts.embedding in params and desc.parts.head in dict(model.state_dict())
        linear = {n.rsplit(".", 1)[0] for n in params if n.endswith(".weight")}
        assert all(any(m.endswith(t) for m in linear) for t in desc.parts.lora_targets), name
        from kiln.plan.memory import count_params

        assert count_params(cfg)[0] == sum(p.numel() for p in model.parameters()), name


def test_the_demonstration_family_trains_plans_checkpoints_and_releases(qwen2, tmp_path, pretrain_job, tiny_tokenizer,
                                                                       model_dict, one_thread):
    import transformers

    from kiln.plan.memory import BatchConfig, HardwareConfig, count_params, make_plan
    from kiln.pretrained.source import import_pretrained
    from kiln.release.bundle import load_release, verify_release, write_release
    from kiln.train.checkpoint import load_for_inference, load_state
    from kiln.train.loop import main
    from tests.kiln.model.qwen2_family import Qwen2

    enc, _ = tiny_tokenizer
    model = {**QWEN2, "vocab_size": model_dict["vocab_size"]}
    cfg = ModelConfig(**model)
    built = families.build_model(cfg)
    assert isinstance(built, Qwen2) and built.model.layers[0].self_attn.q_proj.bias is not None
    # plans: the family's own counts, checked against the built model
    assert count_params(cfg)[0] == sum(p.numel() for p in built.parameters())
    plan = make_plan(cfg, BatchConfig(seq_len=32, global_batch=8, micro_batch=8), HardwareConfig(device="cpu", memory_gb=8))
    assert plan.params == count_params(cfg)[0] and plan.micro_batch == 8
    # LoRA finds the family's projections (the default targets mean all of them)
    assert len(apply_lora(families.build_model(cfg), LoRAConfig(enabled=True))) == 7 * cfg.n_layer
    # trains: a pretraining run through the Trainer, to a checkpoint of the family
    res = main(["--config", str(pretrain_job(tmp_path, model=model, max_steps=30, eval_interval=30, ckpt_interval=30)),
                "--device", "cpu"])
    assert res["final_val_loss"] < res["initial_val_loss"] - 0.3, res["history"]
    state, meta = load_state(Path(res["checkpoint"]))
    assert meta["model"] == serialised(cfg) and meta["model"]["family"] == "qwen2"
    trained, _, _ = load_for_inference(res["checkpoint"])
    assert isinstance(trained, Qwen2)
    # releases: transformers loads the bundle as Qwen2ForCausalLM, with no Kiln code, and gives Kiln's logits
    write_release(res["checkpoint"], tmp_path / "release", card="# demo\n")
    verify_release(tmp_path / "release")
    assert json.loads((tmp_path / "release" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "release").eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    idx = torch.randint(0, enc.n_vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained(idx)
        assert torch.allclose(hf(idx).logits, want, atol=1e-5, rtol=1e-5)
        back, _ = load_release(tmp_path / "release")
        assert torch.equal(back(idx), want)
    # imports back: the bundle is a Hugging Face folder of model_type qwen2, read by the family's own reader
    record = import_pretrained(tmp_path / "release", tmp_path / "imported")
    imported, _ = load_state(Path(record["checkpoint"]))
    assert set(imported["model"]) == set(state["model"])
    assert all(torch.equal(imported["model"][k], state["model"][k]) for k in state["model"])
