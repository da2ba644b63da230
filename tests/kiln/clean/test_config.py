"""Tests of kiln/clean/config.py: the clean config's defaults, unknown keys and wrong types named, MinHash's
num_perm = bands x rows, and the generated config pickling for worker processes."""

from __future__ import annotations

import pytest

from kiln.clean.config import CleanConfig
from kiln.common.config import ConfigError


def test_config_defaults_are_fineweb_minhash() -> None:
    mh = CleanConfig().minhash
    assert (mh.enabled, mh.ngram, mh.num_perm, mh.bands, mh.rows) == (True, 5, 112, 14, 8)


def test_unknown_config_key_is_an_error() -> None:
    with pytest.raises(ConfigError, match="unknown key 'min_word'.*Did you mean 'min_words'"):
        CleanConfig.from_dict({"min_word": 10})
    with pytest.raises(ConfigError, match=r"clean\.minhash: unknown key 'perms'"):
        CleanConfig.from_dict({"minhash": {"perms": 64}})


def test_wrong_value_type_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"clean\.min_words must be a whole number \(>= 0\), got '50'"):
        CleanConfig.from_dict({"min_words": "50"})
    with pytest.raises(ConfigError, match=r"clean\.minhash\.enabled must be bool, got 1"):
        CleanConfig.from_dict({"minhash": {"enabled": 1}})
    assert CleanConfig.from_dict({"max_symbol_to_word_ratio": 1}).max_symbol_to_word_ratio == 1


def test_num_perm_must_equal_bands_times_rows() -> None:
    with pytest.raises(ConfigError, match=r"num_perm=128 must equal bands \* rows = 14 \* 8 = 112"):
        CleanConfig.from_dict({"minhash": {"num_perm": 128}})
    cfg = CleanConfig.from_dict({"minhash": {"num_perm": 128, "bands": 16, "rows": 8}, "min_words": 20})
    assert cfg.minhash.bands == 16 and cfg.min_words == 20


def test_the_generated_config_pickles_for_worker_processes() -> None:
    import pickle

    cfg = CleanConfig.from_dict({"min_words": 20, "c4": {"min_sentences": 2}, "minhash": {"enabled": False}})
    again = pickle.loads(pickle.dumps(cfg))
    assert type(again) is CleanConfig and again == cfg and again.c4.min_sentences == 2
    assert again.shard_stage_hash() == cfg.shard_stage_hash()
