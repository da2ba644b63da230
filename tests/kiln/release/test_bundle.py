"""Tests of kiln/release/bundle.py: a written release loads with bit-identical logits, and a modified byte or a missing file
is caught naming the file."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch
from safetensors.torch import load_file

from kiln.common.files import sha256_file
from kiln.release.bundle import load_release, verify_release, write_release
from kiln.train.checkpoint import load_for_inference
from tests.kiln.release.test_release import CFG, checkpoint  # noqa: F401  (checkpoint is a fixture)


def test_write_then_load_release_gives_bit_identical_logits(tmp_path, checkpoint, tiny_tokenizer) -> None:
    enc, tok = tiny_tokenizer
    ckpt, original = checkpoint
    bundle = tmp_path / "release"
    manifest = write_release(tmp_path / "run", bundle, card="# tiny\n", extra={"val_loss": 3.0})
    names = {"model.safetensors", "config.json", "generation_config.json", "tokenizer.kiln.json", "kiln.json", "README.md",
             "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}  # no vocab.json: not GPT-2's split
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
