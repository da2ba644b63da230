"""Tests for kiln.model.llama.model: shapes with grouped-query attention, causality, the rotation (Hugging Face's
halves convention, a pure rotation), an untied head, and the block-size check."""

from __future__ import annotations

import pytest
import torch

from kiln.model.config import ModelConfig
from kiln.model.llama.model import Llama, rope_tables, rotate

CFG = dict(family="llama", vocab_size=256, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)


def make(**kw) -> Llama:
    torch.manual_seed(0)
    return Llama(ModelConfig(**{**CFG, **kw}))


def test_forward_shapes_with_grouped_query_attention() -> None:
    m = make()
    attn = m.model.layers[0].self_attn
    assert attn.k_proj.weight.shape == (32, 64) and attn.q_proj.weight.shape == (64, 64)  # 2 kv heads of 16, 4 q
    out = m(torch.randint(0, 256, (3, 11)))
    assert out.shape == (3, 11, 256) and out.dtype == torch.float32


def test_future_tokens_do_not_change_earlier_logits() -> None:
    m = make().eval()
    idx = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, 9:] = (changed[:, 9:] + 5) % 256
    with torch.no_grad():
        a, b = m(idx), m(changed)
    assert torch.equal(a[:, :9], b[:, :9]) and not torch.allclose(a[:, 9:], b[:, 9:])


def test_the_rotation_turns_channel_pairs_by_position_over_theta() -> None:
    cfg = ModelConfig(**CFG, rope_theta=100.0)
    cos, sin = rope_tables(cfg)  # (32, 16)
    assert cos.shape == (32, 16) and torch.equal(cos[0], torch.ones(16)) and torch.equal(sin[0], torch.zeros(16))
    # pair (i, i + 8) turns by p / theta^(2i / 16): position 3, pair 1 by 3 / 100^(1/8)
    angle = 3 / 100.0 ** (2 / 16)
    x = torch.zeros(1, 1, 1, 16)
    x[..., 1] = 1.0
    y = rotate(x, cos[3:4], sin[3:4])
    torch.testing.assert_close(y[0, 0, 0, [1, 9]], torch.tensor([torch.cos(torch.tensor(angle)), torch.sin(torch.tensor(angle))]))
    v = torch.randn(2, 4, 32, 16)
    torch.testing.assert_close(rotate(v, cos, sin).norm(dim=-1), v.norm(dim=-1))  # a rotation keeps lengths


def test_an_untied_head_is_its_own_weight_and_counted() -> None:
    tied, untied = make(), make(tie_embeddings=False)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert untied.num_params(non_embedding=False) - tied.num_params(non_embedding=False) == 256 * 64


def test_sequence_longer_than_block_size_is_rejected_with_both_numbers() -> None:
    with pytest.raises(ValueError, match=r"sequence of 33 tokens is longer than model\.block_size=32"):
        make()(torch.zeros(1, 33, dtype=torch.long))
