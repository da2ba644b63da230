"""Tests of kiln/model/config.py: a width the heads do not divide names both fields."""

from __future__ import annotations

import pytest

from kiln.model.config import ModelConfig


def test_n_embd_not_divisible_by_heads_names_both_fields() -> None:
    with pytest.raises(ValueError, match=r"model\.n_embd \(30\) must be divisible by model\.n_head \(4\)"):
        ModelConfig(n_embd=30, n_head=4)
