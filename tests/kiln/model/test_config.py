"""Tests of kiln/model/config.py: a width the heads do not divide names both fields."""

from __future__ import annotations

import pytest

from kiln.model.config import ModelConfig, padded_vocab


def test_n_embd_not_divisible_by_heads_names_both_fields() -> None:
    with pytest.raises(ValueError, match=r"model\.n_embd \(30\) must be divisible by model\.n_head \(4\)"):
        ModelConfig(n_embd=30, n_head=4)


def test_padded_vocab() -> None:
    assert padded_vocab(300) == 320
    assert padded_vocab(320) == 320
    assert padded_vocab(50257) == 50304
    assert padded_vocab(1, multiple=8) == 8
