"""Tests of kiln/model/cache.py: a forked KV cache holds each row's positions for its copies, and a fork's rows are its own."""

from __future__ import annotations

import torch

from kiln.model.cache import KVCache
from tests.kiln.model.test_generate import make, prompts


def test_a_forked_cache_holds_each_rows_positions_for_its_copies() -> None:
    m = make("llama")
    cache = KVCache.for_model(m, 2, max_len=16)
    with torch.no_grad():
        m(prompts(2, 5), cache=cache)
    forked = cache.fork(3)
    assert forked.k.shape[1] == 6 and forked.pos == 5 and forked.max_len == 16
    for i in range(6):
        assert torch.equal(forked.k[:, i], cache.k[:, i // 3]) and torch.equal(forked.v[:, i], cache.v[:, i // 3])
    forked.k[:, 0] += 1.0  # a fork's rows are its own
    assert torch.equal(forked.k[:, 1], cache.k[:, 0])
