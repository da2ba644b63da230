"""Tests of kiln/model/quant.py: NF4's round trip is within half a level gap of each block's scale, and a weight whose
block count 256 does not divide takes the largest divisor below it."""

from __future__ import annotations

import torch

from kiln.model.config import ModelConfig
from kiln.model.gpt2.model import GPT
from kiln.model.lora import apply_lora
from kiln.model.quant import (NF4_BLOCK, NF4_MAX_GAP, NF4_SCALER_BLOCK, dequantize, is_nf4, scaler_block,
                              storage_bytes, to_nf4_weight)
from tests.kiln.model.test_qlora import QLORA


def test_nf4_round_trip_is_within_half_a_level_gap_of_each_block_scale() -> None:
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)) * 0.02
    q = to_nf4_weight(w, "w")
    assert is_nf4(q) and q.shape == w.shape and q.dtype == torch.float32
    back = dequantize(q)
    assert back.dtype == torch.float32 and not is_nf4(back)
    blocks, err = w.reshape(-1, NF4_BLOCK), (back - w).reshape(-1, NF4_BLOCK)  # (n_blocks, 64)
    absmax = blocks.abs().amax(1)  # (n_blocks,) each block's scale
    # the nearest level is at most half the widest gap (-1 .. -0.6962) of the scale away; the scales are stored as
    # 8-bit steps of (their largest distance from the mean, per 256 blocks) / 128, so one step (a rounding, or the
    # clamp of +128 to 127) more at most
    centred = (absmax - absmax.mean()).reshape(-1, NF4_SCALER_BLOCK).abs().amax(1)  # (n_scaler_blocks,)
    bound = absmax * NF4_MAX_GAP / 2 + centred.repeat_interleave(NF4_SCALER_BLOCK) / 128  # (n_blocks,)
    assert (err.abs().amax(1) <= bound).all()
    rel = (err.norm() / blocks.norm()).item()
    assert 0.05 < rel < 0.11, rel  # NF4 of a Gaussian: about 9% relative RMS error
    assert storage_bytes(q) / storage_bytes(w.to(torch.bfloat16)) < 0.27  # 4 bits + scales vs 16 bits


def test_a_weight_whose_block_count_256_does_not_divide_takes_the_largest_divisor_below_it() -> None:
    """SmolLM2's 576 x 576 attention projections have 5,184 NF4 blocks: their scales are quantised in blocks of 216
    (the largest divisor of 5,184 below 256), and the round trip keeps NF4's error."""
    assert [scaler_block(n) for n in (2048, 5184, 1728, 192, 61, 514)] == [256, 216, 216, 192, 61, 2]
    w = torch.randn(576, 576, generator=torch.Generator().manual_seed(1)) * 0.02
    q = to_nf4_weight(w, "model.layers.0.self_attn.q_proj")
    assert is_nf4(q) and q.scaler_block_size == 216 and q.shape == w.shape
    rel = ((dequantize(q) - w).norm() / w.norm()).item()
    assert 0.05 < rel < 0.11, rel
    assert torch.equal(dequantize(to_nf4_weight(w, "again")), dequantize(q))  # the same bits every time
    small = GPT(ModelConfig(vocab_size=320, block_size=16, n_layer=1, n_head=2, n_embd=64))
    wrapped = apply_lora(small, QLORA)  # c_attn (192 x 64): 192 blocks, one scaler block of 192
    assert all(small.get_submodule(n).quantized for n in wrapped)
