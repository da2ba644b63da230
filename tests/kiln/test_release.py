"""Tests for kiln.release: the Hugging Face GPT-2 layout, bit-identical round trip, checksum verification.

Run: python -m pytest tests/kiln/test_release.py -q
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.checkpoint import load_for_inference, save_checkpoint
from kiln.model import GPT, GPTConfig
from kiln.release import CONV1D, from_hf_state_dict, hf_config, load_release, to_hf_state_dict, verify_release, write_release
from kiln.storage import sha256_file

CFG = GPTConfig(vocab_size=320, block_size=32, n_layer=2, n_head=2, n_embd=32)


def trained_like_model(seed: int = 0) -> GPT:
    """A tiny GPT whose biases and norms are not at their init values (so a dropped tensor would show)."""
    torch.manual_seed(seed)
    m = GPT(CFG)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m.eval()


@pytest.fixture
def checkpoint(tmp_path, tiny_tokenizer) -> tuple[Path, GPT]:
    _, tok = tiny_tokenizer
    m = trained_like_model()
    path = save_checkpoint(tmp_path / "run" / "checkpoints", 12, {"model": m.state_dict()},
                           {"model": asdict(CFG), "val_loss": 3.0}, extra_files={"tokenizer.json": tok})
    return path, m


def test_to_hf_state_dict_transposes_conv1d_weights_and_drops_the_head() -> None:
    m = trained_like_model()
    sd = m.state_dict()
    hf = to_hf_state_dict(sd)
    assert set(hf) == set(sd) - {"lm_head.weight"}
    transposed = [k for k in hf if k.endswith(CONV1D)]
    assert len(transposed) == 4 * CFG.n_layer
    for k, t in hf.items():
        assert t.dtype == torch.float32 and t.is_contiguous()
        assert torch.equal(t, sd[k].t() if k in transposed else sd[k]), k
    C = CFG.n_embd
    assert hf["transformer.h.0.attn.c_attn.weight"].shape == (C, 3 * C)  # Conv1D: (in, out)
    assert hf["transformer.h.0.mlp.c_fc.weight"].shape == (C, 4 * C)
    assert hf["transformer.h.0.mlp.c_proj.weight"].shape == (4 * C, C)
    assert hf["transformer.h.1.attn.c_proj.weight"].shape == (C, C)
    # Conv1D computes x @ W + b; with the exported weight that equals the model's Linear
    x = torch.randn(3, C)
    attn = m.transformer.h[0].attn.c_attn
    got = x @ hf["transformer.h.0.attn.c_attn.weight"] + hf["transformer.h.0.attn.c_attn.bias"]
    assert torch.allclose(got, attn(x), atol=1e-6)
    back = from_hf_state_dict(hf)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_hf_config_describes_the_model() -> None:
    cfg = hf_config(CFG, eot=297)
    assert cfg["model_type"] == "gpt2" and cfg["architectures"] == ["GPT2LMHeadModel"]
    assert (cfg["vocab_size"], cfg["n_positions"], cfg["n_embd"], cfg["n_layer"], cfg["n_head"]) == (320, 32, 32, 2, 2)
    assert cfg["activation_function"] == "gelu_new"  # tanh GELU, as the model uses
    assert cfg["eos_token_id"] == cfg["bos_token_id"] == 297 and cfg["tie_word_embeddings"] is True
    with pytest.raises(ValueError, match="model.bias=true"):
        hf_config(GPTConfig(vocab_size=320, block_size=32, n_layer=2, n_head=2, n_embd=32, bias=False), 297)


def test_write_then_load_release_gives_bit_identical_logits(tmp_path, checkpoint, tiny_tokenizer) -> None:
    enc, tok = tiny_tokenizer
    ckpt, original = checkpoint
    bundle = tmp_path / "release"
    manifest = write_release(tmp_path / "run", bundle, card="# tiny\n", extra={"val_loss": 3.0})
    names = {"model.safetensors", "config.json", "generation_config.json", "tokenizer.kiln.json", "kiln.json", "README.md"}
    assert set(manifest["files"]) == names
    assert {p.name for p in bundle.iterdir()} == names | {"SHA256SUMS"}
    assert manifest["checkpoint"] == str(ckpt)
    assert manifest["bytes"] == sum((bundle / n).stat().st_size for n in names)
    sums = dict(reversed(line.split("  ")) for line in (bundle / "SHA256SUMS").read_text().splitlines())
    assert sums == {n: sha256_file(bundle / n) for n in names}
    kiln_meta = json.loads((bundle / "kiln.json").read_text())
    assert kiln_meta["step"] == 12 and kiln_meta["val_loss"] == 3.0 and kiln_meta["model"] == asdict(CFG)
    assert json.loads((bundle / "config.json").read_text())["eos_token_id"] == enc.eot_token
    assert "lm_head.weight" not in load_file(str(bundle / "model.safetensors"))

    released, enc2 = load_release(bundle)
    from_ckpt, _, _ = load_for_inference(ckpt)
    assert not released.training
    assert released.lm_head.weight is released.transformer.wte.weight
    assert enc2.encode_ordinary("a dog finds the river") == enc.encode_ordinary("a dog finds the river")
    idx = torch.randint(0, enc.n_vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b, c = released(idx), from_ckpt(idx), original(idx)
    assert torch.equal(a, b) and torch.equal(a, c)
    for k, v in original.state_dict().items():
        assert torch.equal(released.state_dict()[k], v), k


def test_modified_byte_is_caught_naming_the_file(tmp_path, checkpoint) -> None:
    ckpt, _ = checkpoint
    bundle = tmp_path / "release"
    write_release(ckpt, bundle, card="card")
    verify_release(bundle)
    f = bundle / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF  # inside the tensor data: the file still parses
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model\.safetensors: checksum does not match SHA256SUMS") as err:
        verify_release(bundle)
    assert str(f) in str(err.value)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_release(bundle)


def test_missing_file_is_named(tmp_path, checkpoint) -> None:
    ckpt, _ = checkpoint
    bundle = tmp_path / "release"
    write_release(ckpt, bundle, card="card")
    (bundle / "README.md").unlink()
    with pytest.raises(ValueError, match=r"README\.md: listed in SHA256SUMS but missing"):
        verify_release(bundle)
