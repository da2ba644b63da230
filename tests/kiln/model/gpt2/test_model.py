"""Tests for kiln.model.gpt2.model: shapes, weight tying, causality, the block-size check, GPT-2's scaled init
(generation: tests/kiln/model/test_generate.py)."""

from __future__ import annotations

import pytest
import torch

from kiln.model.config import ModelConfig
from kiln.model.gpt2.model import GPT


def make(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=300, block_size=32, n_layer=2, n_head=2, n_embd=32)
    cfg.update(kw)
    return GPT(ModelConfig(**cfg))


def test_forward_shape_and_dtype() -> None:
    m = make()
    idx = torch.randint(0, 300, (3, 17))
    out = m(idx)
    assert out.shape == (3, 17, 300)
    assert out.dtype == torch.float32


def test_lm_head_is_tied_to_token_embedding() -> None:
    m = make()
    assert m.lm_head.weight is m.transformer.wte.weight
    # one tensor, counted once
    names = [n for n, _ in m.named_parameters()]
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names
    # both names still appear in the state dict (the layout HF GPT-2 expects before dropping the head)
    sd = m.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr()


def test_causal_future_tokens_do_not_change_earlier_logits() -> None:
    m = make().eval()
    idx = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, 12:] = (changed[:, 12:] + 7) % 300
    with torch.no_grad():
        a, b = m(idx), m(changed)
    assert torch.equal(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_sequence_longer_than_block_size_is_rejected_with_both_numbers() -> None:
    m = make()
    with pytest.raises(ValueError, match=r"sequence of 33 tokens is longer than model\.block_size=32"):
        m(torch.zeros(1, 33, dtype=torch.long))
    assert m(torch.zeros(1, 32, dtype=torch.long)).shape == (1, 32, 300)


def test_residual_projections_get_scaled_init() -> None:
    m = make(n_layer=2, n_embd=64, vocab_size=64)
    # std 0.02 / sqrt(2 * n_layer) = 0.01 for c_proj; 0.02 for the others (4096+ samples: loose tolerance)
    proj = torch.cat([b.attn.c_proj.weight.flatten() for b in m.transformer.h])
    fc = torch.cat([b.mlp.c_fc.weight.flatten() for b in m.transformer.h])
    assert abs(proj.std().item() - 0.01) < 0.001
    assert abs(fc.std().item() - 0.02) < 0.001
    assert all(torch.count_nonzero(b.attn.c_attn.bias) == 0 for b in m.transformer.h)
