"""Tests of kiln/pretrained/weights.py: a shape mismatch between config and weights, a missing weight, a missing shard named in
the index, and a pickle-only checkpoint (refused unread) are errors naming them."""

import json

import pytest
from safetensors.torch import load_file, save_file

from kiln.pretrained.config import PretrainedError
from kiln.pretrained.source import load_pretrained
from tests.kiln.pretrained.pretrained_kit import _copy


def test_shape_mismatch_between_config_and_weights(folders, tmp_path):
    bad = _copy(folders, tmp_path)
    doc = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**doc, "n_positions": 32}))
    with pytest.raises(PretrainedError, match=r"transformer.wpe.weight has shape \(64, 32\) but config.json implies \(32, 32\)"):
        load_pretrained(bad)


def test_missing_weight_is_named(folders, tmp_path):
    bad = _copy(folders, tmp_path)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["transformer.ln_f.weight"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(PretrainedError, match=r"weight 'transformer.ln_f.weight' missing"):
        load_pretrained(bad)


def test_missing_shard_named_in_the_index(folders, tmp_path):
    bad = _copy(folders, tmp_path, ("llama", "llama3"))
    shard = sorted(bad.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(PretrainedError, match=rf"{shard.name}: shard named in model.safetensors.index.json is missing"):
        load_pretrained(bad)


def test_pickle_only_checkpoint_is_refused_unread(folders, tmp_path):
    bad = _copy(folders, tmp_path)
    (bad / "model.safetensors").unlink()
    (bad / "pytorch_model.bin").write_bytes(b"\x80\x04 not to be unpickled")
    with pytest.raises(PretrainedError, match=r"pytorch_model.bin: a pickle checkpoint, which Kiln never loads.*safe_serialization"):
        load_pretrained(bad)
