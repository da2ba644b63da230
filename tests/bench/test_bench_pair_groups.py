"""bench/bench_pair_groups.py: the two ways of a step give the same loss, and the tokens each runs are counted."""

import pytest
import torch
from bench_module import load_bench

from kiln.model.config import ModelConfig
from kiln.model.families import build_model

IGNORE = -100


def pairs(lengths: list[int], width: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose targets end at ``lengths`` (x, y (N, width)), right-padded."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 320, (len(lengths), width), generator=g)
    y = torch.full_like(x, IGNORE)
    for i, n in enumerate(lengths):
        y[i, n // 2 : n] = x[i, n // 2 + 1 : n + 1] if n < width else torch.randint(0, 320, (n - n // 2,), generator=g)
    return x, y


def test_one_batch_and_grouped_steps_give_the_same_loss_and_count_their_tokens(monkeypatch):
    bench = load_bench("bench_pair_groups")
    monkeypatch.setattr("kiln.posttrain.logprobs.PASS_TOKENS", 16)  # rows this small: a split pays
    torch.manual_seed(0)
    cfg = ModelConfig(family="llama", vocab_size=320, block_size=48, n_layer=1, n_head=2, n_kv_head=1, n_embd=32)
    policy, ref = build_model(cfg), build_model(cfg).eval()
    x, y = pairs([6, 40, 5, 7])  # chosen rows (6, 40), then rejected (5, 7)
    _, one = bench.step(policy, ref, x, y, grouped=False)
    _, grouped = bench.step(policy, ref, x, y, grouped=True)
    assert grouped == pytest.approx(one, abs=1e-5)
    assert all(p.grad is None for p in policy.parameters())  # each step leaves no gradient behind
    one_batch, grouped_tokens = bench.padded_tokens(y)
    assert one_batch == 4 * 40 and grouped_tokens == 3 * 7 + 40
