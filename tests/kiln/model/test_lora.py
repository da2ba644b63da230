"""Tests for kiln.model.lora: adapters start as a no-op, train alone, and merge into plain GPT weights that release unchanged.

Run: python -m pytest tests/kiln/model/test_lora.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.train.checkpoint import save_checkpoint
from kiln.model.lora import (LoRAConfig, LoRALinear, adapters_disabled, apply_lora, load_lora_state_dict, lora_state_dict,
                       merged_state_dict, trainable_parameters)
from kiln.model.config import ModelConfig
from kiln.model.gpt2.model import GPT

CFG = ModelConfig(vocab_size=320, block_size=16, n_layer=2, n_head=2, n_embd=32)


def models():
    torch.manual_seed(0)
    base = GPT(CFG)
    adapted = GPT(CFG)
    adapted.load_state_dict(base.state_dict())
    return base, adapted


def train_a_little(model, steps=5):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randint(0, 320, (4, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 320), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return x


def test_adapters_start_as_identity_and_only_they_train() -> None:
    base, adapted = models()
    wrapped = apply_lora(adapted, LoRAConfig(enabled=True, rank=4))
    assert len(wrapped) == 4 * CFG.n_layer
    assert all(isinstance(adapted.get_submodule(n), LoRALinear) for n in wrapped)
    x = torch.randint(0, 320, (2, 16))
    assert torch.equal(adapted(x), base(x))  # B starts at zero
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    per_layer = 4 * (32 + 96) + 4 * (32 + 32) + 4 * (32 + 128) + 4 * (128 + 32)  # r * (in + out) per target
    assert trainable_parameters(adapted) == CFG.n_layer * per_layer
    frozen_before = {k: v.clone() for k, v in adapted.state_dict().items() if "lora_" not in k}
    train_a_little(adapted)
    after = adapted.state_dict()
    assert all(torch.equal(after[k], v) for k, v in frozen_before.items())  # the base never moves
    assert any(after[k].abs().sum() > 0 for k in after if k.endswith("lora_B"))


def test_merged_weights_are_plain_gpt_weights_with_the_same_logits() -> None:
    base, adapted = models()
    apply_lora(adapted, LoRAConfig(enabled=True, rank=4, alpha=8))
    x = train_a_little(adapted)
    adapted.eval()
    merged = merged_state_dict(adapted)
    assert set(merged) == set(base.state_dict())  # the exact GPT keys: checkpoints and releases need nothing new
    plain = GPT(CFG)
    plain.load_state_dict(merged)
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(x), adapted(x), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(plain(x), base(x))
        with adapters_disabled(adapted):  # the frozen base: the reference model, without a second copy
            assert torch.equal(adapted(x), base.eval()(x))
        assert not torch.allclose(adapted(x), base(x))  # re-enabled on exit


def test_merge_math_is_w_plus_scaled_b_a() -> None:
    lin = torch.nn.Linear(6, 5)
    layer = LoRALinear(lin, rank=2, alpha=6.0, dropout=0.0)
    with torch.no_grad():
        layer.lora_B.copy_(torch.arange(10, dtype=torch.float32).reshape(5, 2) / 10)
    expected = lin.weight + 3.0 * layer.lora_B @ layer.lora_A
    torch.testing.assert_close(layer.merged_weight(), expected)
    x = torch.randn(3, 6)
    torch.testing.assert_close(layer(x), x @ expected.t() + lin.bias)


def test_adapter_state_round_trips_and_mismatches_are_named() -> None:
    _, a = models()
    apply_lora(a, LoRAConfig(enabled=True, rank=4))
    train_a_little(a)
    state = lora_state_dict(a)
    _, b = models()
    apply_lora(b, LoRAConfig(enabled=True, rank=4))
    load_lora_state_dict(b, state)
    x = torch.randint(0, 320, (2, 16))
    assert torch.equal(a.eval()(x), b.eval()(x))
    _, c = models()
    apply_lora(c, LoRAConfig(enabled=True, rank=4, targets=["attn.c_attn"]))
    with pytest.raises(ValueError, match="same lora settings"):
        load_lora_state_dict(c, state)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="lora.rank"):
        LoRAConfig(rank=0)
    with pytest.raises(ValueError, match="lora.targets: unknown module 'attn.q'"):
        LoRAConfig(targets=["attn.q"])


def test_release_of_a_merged_checkpoint_reloads_with_the_same_logits(tmp_path, tiny_tokenizer) -> None:
    from dataclasses import asdict

    from kiln.release.bundle import load_release, write_release

    _, tok_path = tiny_tokenizer
    _, adapted = models()
    apply_lora(adapted, LoRAConfig(enabled=True, rank=4))
    x = train_a_little(adapted)
    ckpt = save_checkpoint(tmp_path / "ckpt", 1, {"model": merged_state_dict(adapted)}, {"model": asdict(CFG)},
                           {"tokenizer.json": tok_path})
    write_release(ckpt, tmp_path / "bundle", "# card\n")
    released, _ = load_release(tmp_path / "bundle")
    with torch.no_grad():
        torch.testing.assert_close(released(x), adapted.eval()(x), rtol=1e-5, atol=1e-5)


LLAMA = ModelConfig(family="llama", vocab_size=320, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)


def test_llama_gets_adapters_on_its_seven_projections_and_merges_to_plain_weights() -> None:
    from kiln.model.families import build_model

    torch.manual_seed(0)
    base = build_model(LLAMA)
    adapted = build_model(LLAMA)
    adapted.load_state_dict(base.state_dict())
    wrapped = apply_lora(adapted, LoRAConfig(enabled=True, rank=4))  # the default targets follow the family
    assert len(wrapped) == 7 * LLAMA.n_layer
    assert {n.split(".", 3)[3] for n in wrapped} == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                      "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    c, kv, i = 32, 16, LLAMA.intermediate_size  # GQA: k and v are 2 heads of 8
    per_layer = 4 * ((c + c) * 2 + (c + kv) * 2 + (c + i) * 2 + (i + c))  # r * (in + out) per target
    assert trainable_parameters(adapted) == LLAMA.n_layer * per_layer
    x = train_a_little(adapted)
    merged = merged_state_dict(adapted.eval())
    assert set(merged) == set(base.state_dict())
    plain = build_model(LLAMA)
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(x), adapted(x), rtol=1e-5, atol=1e-5)
        with adapters_disabled(adapted):
            assert torch.equal(adapted(x), base.eval()(x))
    only_q = build_model(LLAMA)
    assert len(apply_lora(only_q, LoRAConfig(enabled=True, targets=["self_attn.q_proj"]))) == LLAMA.n_layer
    with pytest.raises(ValueError, match="'mlp.c_fc' is not a layer of the llama family; choose from self_attn.q_proj"):
        apply_lora(build_model(LLAMA), LoRAConfig(enabled=True, targets=["mlp.c_fc"]))
    with pytest.raises(ValueError, match="'mlp.up_proj' is not a layer of the gpt2 family; choose from attn.c_attn"):
        apply_lora(GPT(CFG), LoRAConfig(enabled=True, targets=["mlp.up_proj"]))
