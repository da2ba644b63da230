"""Tests for QLoRA (kiln.model.lora with ``quantize: nf4``, kiln.model.quant): the NF4 round trip within its bound,
adapters alone train, SFT and DPO jobs on an NF4 base (bit-exact resume), and merged releases that transformers loads.

Run: python -m pytest tests/kiln/model/test_qlora.py -q
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kiln.common.config import ConfigError, from_dict
from kiln.model.config import ModelConfig
from kiln.model.gpt2.model import GPT
from kiln.model.lora import (LoRAConfig, LoRALinear, adapters_disabled, apply_lora, lora_modules,
                             merged_state_dict)
from kiln.model.quant import NF4_MAX_GAP, is_nf4
from kiln.train.checkpoint import load_state, resolve_checkpoint, save_checkpoint

# 128 wide: every projection's weight holds a whole number of NF4 scaler blocks (64 x 256 values)
CFG = ModelConfig(vocab_size=320, block_size=16, n_layer=2, n_head=2, n_embd=128)
QLORA = LoRAConfig(enabled=True, rank=4, alpha=8, quantize="nf4")


def models(cfg: ModelConfig = CFG) -> tuple[GPT, GPT]:
    torch.manual_seed(0)
    base = GPT(cfg)
    adapted = GPT(cfg)
    adapted.load_state_dict(base.state_dict())
    return base, adapted


def train_a_little(model, steps=5) -> tuple[torch.Tensor, list[float]]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randint(0, 320, (4, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, 320), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return x, losses


def test_only_adapters_train_on_an_unchanged_nf4_base() -> None:
    base, adapted = models()
    wrapped = apply_lora(adapted, QLORA)
    assert len(wrapped) == 4 * CFG.n_layer
    layers = [adapted.get_submodule(n) for n in wrapped]
    assert all(isinstance(m, LoRALinear) and m.quantized and is_nf4(m.base.weight) for m in layers)
    assert not is_nf4(adapted.transformer.wte.weight)  # the embedding (and the tied head) stay as they are
    codes = {n: m.base.weight.quantized_data.clone() for n, m in zip(wrapped, layers)}
    x = torch.randint(0, 320, (2, 16))
    with torch.no_grad():
        start_gap = (adapted(x) - base(x)).abs().max().item()
    assert 0 < start_gap < 0.5  # B = 0: the model is its NF4 base, close to the full-precision one
    logits = adapted(x[:, :-1])
    F.cross_entropy(logits.reshape(-1, 320), x[:, 1:].reshape(-1)).backward()
    with_grad = {n for n, p in adapted.named_parameters() if p.grad is not None}
    assert with_grad == {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert with_grad and all(n.endswith(("lora_A", "lora_B")) for n in with_grad)
    assert sum(p.numel() for n, p in adapted.named_parameters() if n in with_grad) == CFG.n_layer * 4 * (
        (128 + 384) + (128 + 128) + (128 + 512) + (512 + 128))  # r * (in + out) per target
    frozen = {k: v.clone() for k, v in adapted.state_dict().items() if "lora_" not in k and not is_nf4(v)}
    _, losses = train_a_little(adapted, steps=8)
    assert losses[-1] < losses[0] - 0.5, losses
    after = adapted.state_dict()
    assert all(torch.equal(after[k], v) for k, v in frozen.items())
    assert all(torch.equal(m.base.weight.quantized_data, codes[n]) for n, m in zip(wrapped, layers))  # 4-bit codes too


def test_the_reference_is_the_nf4_base_and_merging_dequantises() -> None:
    _, adapted = models()
    apply_lora(adapted, QLORA)
    nf4_base = GPT(CFG)
    nf4_base.load_state_dict(merged_state_dict(adapted))  # B = 0: merged = dequantised base
    x, _ = train_a_little(adapted)
    adapted.eval()
    nf4_base.eval()
    merged = merged_state_dict(adapted)
    assert all(type(v) is torch.Tensor and v.dtype == torch.float32 for v in merged.values())
    assert set(merged) == set(GPT(CFG).state_dict())
    plain = GPT(CFG).eval()
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), adapted(x), rtol=1e-5, atol=1e-5)
        with adapters_disabled(adapted):  # DPO's reference: the same quantised base, adapters off
            torch.testing.assert_close(adapted(x), nf4_base(x), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(adapted(x), nf4_base(x), atol=1e-3)


def test_given_the_full_precision_start_the_adapters_fold_into_it_not_into_the_nf4_base() -> None:
    base, adapted = models()
    apply_lora(adapted, QLORA)
    full = base.state_dict()
    untrained = merged_state_dict(adapted, full)
    assert all(torch.equal(untrained[k], v) for k, v in full.items())  # B = 0: the starting weights, to the bit
    train_a_little(adapted)
    merged, dequantised = merged_state_dict(adapted, full), merged_state_dict(adapted)
    for name, layer in lora_modules(adapted):
        delta = layer.scale * (layer.lora_B @ layer.lora_A)
        assert torch.equal(merged[f"{name}.weight"], full[f"{name}.weight"] + delta)
        error = (dequantised[f"{name}.weight"] - merged[f"{name}.weight"]).abs().max()
        assert 0 < error <= (full[f"{name}.weight"].abs().max() * NF4_MAX_GAP)  # what the NF4 merge keeps
    with pytest.raises(ValueError, match="is not this model's starting weight"):
        merged_state_dict(adapted, {k: v[:, :64] if v.dim() == 2 else v for k, v in full.items()})


def test_bf16_base_with_float32_adapters() -> None:
    _, adapted = models()
    adapted.to(torch.bfloat16)
    apply_lora(adapted, QLORA)
    layer = adapted.transformer.h[0].attn.c_attn
    assert layer.base.weight.dtype == torch.bfloat16 and layer.lora_A.dtype == torch.float32
    _, losses = train_a_little(adapted, steps=4)
    assert losses[-1] < losses[0], losses
    assert layer.merged_weight().dtype == torch.bfloat16


def test_settings_and_shapes_nf4_cannot_hold_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="lora.quantize: unknown value 'int4'; choose 'none'"):
        LoRAConfig(quantize="int4")
    with pytest.raises(ConfigError, match="unknown key 'quantise'. Did you mean 'quantize'"):
        from_dict(LoRAConfig, {"quantise": "nf4"}, "job.lora")
    narrow = GPT(ModelConfig(vocab_size=320, block_size=16, n_layer=1, n_head=2, n_embd=48))
    with pytest.raises(ValueError, match=r"layer 'transformer.h.0.attn.c_attn' has in_features 48, not a multiple of "
                                         r"the NF4 block size 64; .*leave 'c_attn' out of lora.targets"):
        apply_lora(narrow, QLORA)
    assert not any(isinstance(m, LoRALinear) for m in narrow.modules())  # checked before anything was changed


# ---------------------------------------------------------------------------------------------- release


def test_released_qlora_weights_load_in_transformers_with_the_same_logits(tmp_path, tiny_tokenizer) -> None:
    """Dequantise -> merge -> float32 safetensors. Kiln's QLoRA forward and the released model differ only in the
    order of float32 sums (x W^T + s (x A^T) B^T against x (W + s B A)^T), so 1e-5 holds for logits of order 1."""
    import transformers

    from kiln.release.bundle import load_release, write_release

    _, tok_path = tiny_tokenizer
    _, adapted = models(ModelConfig(vocab_size=320, block_size=16, n_layer=2, n_head=2, n_embd=128, dropout=0.0))
    apply_lora(adapted, QLORA)
    x, _ = train_a_little(adapted)
    adapted.eval()
    merged = merged_state_dict(adapted)
    ckpt = save_checkpoint(tmp_path / "ckpt", 1, {"model": merged}, {"model": asdict(CFG)}, {"tokenizer.json": tok_path})
    write_release(ckpt, tmp_path / "bundle", "# card\n")
    released, _ = load_release(tmp_path / "bundle")
    assert all(torch.equal(released.state_dict()[k], v) for k, v in merged.items())  # the weights as merged, exactly
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "bundle").eval()
    assert hf.dtype == torch.float32
    with torch.no_grad():
        want, got = adapted(x), hf(x).logits  # (B, T, vocab)
    assert got.shape == want.shape == (4, 16, 320)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- jobs


class _Quiet:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def log(self, message: str) -> None:
        self.lines.append(message)


def qlora_model(model_dict: dict) -> dict:
    return {**model_dict, "n_embd": 128, "n_head": 2}


def init_checkpoint(root: Path, tok_path: Path, model: dict) -> Path:
    torch.manual_seed(0)
    cfg = ModelConfig(**model)
    return save_checkpoint(root, 0, {"model": GPT(cfg).state_dict()}, {"model": asdict(cfg)}, {"tokenizer.json": tok_path})


@pytest.fixture
def sft_pairs(tmp_path) -> Path:
    from kiln.posttrain.instructions import build_pairs, write_jsonl

    pairs = tmp_path / "pairs.jsonl"
    write_jsonl(build_pairs([], n_arithmetic=200, seed=0, val_permille=200, max_doc_pairs=0), pairs)
    return pairs


def sft_job(pretrain_job, out: Path, model: dict, init: Path, pairs: Path, **overrides) -> list[str]:
    path = pretrain_job(out, task="sft", model=model, train_files=[str(pairs)], val_files=[], init_from=str(init),
                        optim={"lr": 1e-2, "warmup_steps": 2, "weight_decay": 0.0}, eval_batches=2, **overrides)
    return ["--config", str(path), "--device", "cpu"]


def test_a_qlora_sft_job_lowers_its_loss_and_saves_adapters_and_merged_weights(tmp_path, tiny_tokenizer, model_dict,
                                                                             pretrain_job, sft_pairs) -> None:
    from kiln.train.loop import main

    _, tok_path = tiny_tokenizer
    model = {**qlora_model(model_dict), "dropout": 0.0}
    init = init_checkpoint(tmp_path / "init", tok_path, model)
    rep = _Quiet()
    lora = {"enabled": True, "rank": 8, "quantize": "nf4"}
    res = main(sft_job(pretrain_job, tmp_path / "sft", model, init, sft_pairs, lora=lora, max_steps=12,
                       eval_interval=12, ckpt_interval=12), rep)
    assert any(line.startswith("LoRA rank 8 on 8 layers (frozen weights in NF4): ") for line in rep.lines), rep.lines
    assert res["steps"] == 12 and res["final_val_loss"] < res["initial_val_loss"] - 0.5, res["history"]
    state, meta = load_state(Path(res["checkpoint"]))
    assert set(state["model"]) == set(GPT(ModelConfig(**model)).state_dict())  # plain weights for every reader
    assert all(k.endswith(("lora_A", "lora_B")) for k in state["lora"])  # the NF4 base is not saved: init_from has it
    assert meta["job"]["lora"] == asdict(LoRAConfig(**lora))  # the whole block as the run read it
    start = load_state(resolve_checkpoint(init))[0]["model"]  # saved weights: the start's full precision + B A
    scale = LoRAConfig(**lora).alpha / 8
    for key in [k for k in state["lora"] if k.endswith("lora_A")]:
        owner = key.removesuffix(".lora_A")
        delta = scale * (state["lora"][f"{owner}.lora_B"] @ state["lora"][key])
        torch.testing.assert_close(state["model"][f"{owner}.weight"], start[f"{owner}.weight"] + delta, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="job.lora: LoRA adapts weights that exist; pretraining from random weights trains every weight"):
        main(["--config", str(pretrain_job(tmp_path / "pre", lora={"enabled": True})), "--device", "cpu"], rep)


def test_a_qlora_sft_run_resumes_after_a_crash_bit_identically(tmp_path, tiny_tokenizer, model_dict, pretrain_job,
                                                             sft_pairs) -> None:
    """Adapters, optimizer, data order and dropout's RNG come back from the step-3 checkpoint; the NF4 base is
    quantised again from init_from, the same bits."""
    from kiln.train.loop import main
    from tests.faults import injector

    _, tok_path = tiny_tokenizer
    model = qlora_model(model_dict)  # dropout 0.1: the RNG state matters
    init = init_checkpoint(tmp_path / "init", tok_path, model)
    kw = dict(lora={"enabled": True, "rank": 4, "dropout": 0.1, "quantize": "nf4"}, max_steps=7, eval_interval=3,
              ckpt_interval=3, keep_last=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = main(sft_job(pretrain_job, tmp_path / "ref", model, init, sft_pairs, **kw), _Quiet())
        crash = sft_job(pretrain_job, tmp_path / "crash", model, init, sft_pairs, **kw)
        with pytest.raises(RuntimeError, match="injected failure at step 5"):
            main(crash, _Quiet(), [injector(fail_at_step=5)])
        res = main(crash, _Quiet(), [injector(fail_at_step=5)])
    finally:
        torch.set_num_threads(threads)
    assert Path(res["resumed_from"]).name == "step_0000003" and res["steps"] == 7
    assert res["history"] == ref["history"] and res["final_train_loss"] == ref["final_train_loss"]
    a, _ = load_state(Path(ref["checkpoint"]))
    b, _ = load_state(Path(res["checkpoint"]))
    for part in ("model", "lora"):
        assert a[part].keys() == b[part].keys() and all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part


def test_a_qlora_dpo_job_starts_at_log_2_against_its_own_nf4_base(tmp_path, tiny_tokenizer, model_dict) -> None:
    from kiln.posttrain.dpo import main
    from kiln.posttrain.instructions import build_pairs, write_jsonl
    from kiln.posttrain.preferences import build_preferences
    from tests.kiln.posttrain.test_dpo import dpo_job

    _, tok_path = tiny_tokenizer
    model = {**qlora_model(model_dict), "dropout": 0.0}
    init = init_checkpoint(tmp_path / "init", tok_path, model)
    data = tmp_path / "prefs.jsonl"
    write_jsonl(build_preferences(build_pairs([], n_arithmetic=60, seed=5, val_permille=250, max_doc_pairs=0), seed=0), data)
    rep = _Quiet()
    res = main(["--config", str(dpo_job(tmp_path / "dpo", tok_path, model, init, data, max_steps=4, eval_interval=4,
                                        ckpt_interval=4, lora={"enabled": True, "rank": 4, "quantize": "nf4"})),
                "--device", "cpu"], rep)
    assert res["steps"] == 4 and res["lora"]["quantize"] == "nf4" and res["reference"] == str(init)
    first = res["history"][0]  # before any step the policy is its reference: every reward is 0
    assert first["val_loss"] == pytest.approx(math.log(2), abs=1e-6) and first["val_reward_margin"] == pytest.approx(0, abs=1e-6)
    last = res["history"][-1]
    assert last["val_loss"] != first["val_loss"]
    state, _ = load_state(Path(res["checkpoint"]))
    assert all(k.endswith(("lora_A", "lora_B")) for k in state["lora"]) and not any(is_nf4(v) for v in state["model"].values())
