"""Tests of kiln/pretrained/config.py: a folder without config.json, an unsupported model type and a config option Kiln
cannot compute are refused by name."""

import json

import pytest

from kiln.pretrained.config import PretrainedError
from kiln.pretrained.source import load_pretrained
from tests.kiln.pretrained.pretrained_kit import _copy


def test_folder_without_config_json(folders, tmp_path):
    bad = _copy(folders, tmp_path)
    (bad / "config.json").unlink()
    with pytest.raises(PretrainedError, match=r"bad/config.json: missing; .*save_pretrained"):
        load_pretrained(bad)


def test_unsupported_model_type_names_it_and_what_is_supported(folders, tmp_path):
    bad = _copy(folders, tmp_path)
    doc = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**doc, "model_type": "bert"}))
    with pytest.raises(PretrainedError, match=r"model_type 'bert' is not supported; Kiln imports gpt2, llama, mistral, qwen3"):
        load_pretrained(bad)


def test_config_option_kiln_cannot_compute_is_refused(folders, tmp_path):
    bad = _copy(folders, tmp_path, ("llama", "llama3"))
    doc = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**doc, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}))
    with pytest.raises(PretrainedError, match=r"config.json: rope type 'llama3' is not supported"):
        load_pretrained(bad)
