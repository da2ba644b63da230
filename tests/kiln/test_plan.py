"""Tests for kiln.plan: parameter counts, the memory model, batch splitting and the errors that say what fits.

Run: python -m pytest tests/kiln/test_plan.py -q
"""

from __future__ import annotations

import re

import pytest

from kiln.model import GPTConfig, flops_per_token
from kiln.plan import GIB, BatchConfig, HardwareConfig, PlanError, count_params, make_plan, memory_breakdown

GPT2_124M = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
TINY = GPTConfig(vocab_size=320, block_size=32, n_layer=2, n_head=2, n_embd=32)


def test_gpt2_small_has_124m_parameters() -> None:
    total, non_embedding = count_params(GPT2_124M)
    assert total == 124_439_808  # the published GPT-2 small count with tied embeddings
    assert non_embedding == 85_056_000
    assert total - non_embedding == (50257 + 1024) * 768


def test_count_params_without_bias_keeps_layernorm_weights() -> None:
    cfg = GPTConfig(vocab_size=320, block_size=32, n_layer=2, n_head=2, n_embd=32, bias=False)
    # per layer 12 C^2 + 2 LayerNorm weights; ln_f weight; embeddings
    assert count_params(cfg)[0] == 2 * (12 * 32**2 + 2 * 32) + 32 + (320 + 32) * 32


@pytest.mark.parametrize("cfg", [GPT2_124M, TINY], ids=["124M", "tiny"])
def test_weights_grads_optimizer_are_16_bytes_per_parameter(cfg) -> None:
    mem = memory_breakdown(cfg, micro_batch=2, seq_len=32, mixed_precision=True)
    assert mem["weights_grads_optimizer"] * GIB == pytest.approx(16 * count_params(cfg)[0], rel=1e-12)
    assert mem["total"] == pytest.approx(mem["weights_grads_optimizer"] + mem["activations"] + mem["logits"])


def test_activation_and_logit_terms() -> None:
    s, b = 32, 4
    fp32 = memory_breakdown(TINY, b, s, mixed_precision=False)
    bf16 = memory_breakdown(TINY, b, s, mixed_precision=True)
    per_layer = s * b * 32 * (34 + 5 * 2 * s / 32)
    assert bf16["activations"] * GIB == pytest.approx(2 * per_layer)
    assert fp32["activations"] == pytest.approx(2 * bf16["activations"])  # fp32 doubles activations
    assert fp32["logits"] * GIB == pytest.approx(b * s * 320 * 8)
    # activations grow linearly in micro-batch
    assert memory_breakdown(TINY, 2 * b, s, False)["activations"] == pytest.approx(2 * fp32["activations"])


@pytest.mark.parametrize("nproc,nnodes,global_batch,micro", [(1, 1, 32, 8), (2, 1, 32, 4), (2, 2, 64, 2), (4, 1, 8, 2)])
def test_micro_batch_times_accumulation_is_the_per_rank_batch(nproc, nnodes, global_batch, micro) -> None:
    plan = make_plan(TINY, BatchConfig(seq_len=32, global_batch=global_batch, micro_batch=micro, max_steps=10),
                     HardwareConfig(nproc_per_node=nproc, nnodes=nnodes, memory_gb=16, peak_tflops=1.0))
    world = nproc * nnodes
    assert plan.world_size == world
    assert plan.micro_batch == micro
    assert plan.micro_batch * plan.grad_accum == global_batch // world
    assert plan.micro_batch * plan.grad_accum * plan.world_size == plan.global_batch == global_batch
    assert plan.parallelism == ("none" if world == 1 else "ddp")
    assert plan.tokens_per_step == global_batch * 32
    assert plan.total_tokens == global_batch * 32 * 10


def test_plan_totals_and_estimates() -> None:
    batch = BatchConfig(seq_len=32, global_batch=8, micro_batch=8, max_steps=100)
    plan = make_plan(TINY, batch, HardwareConfig(memory_gb=8, peak_tflops=2.0))
    fpt = flops_per_token(TINY, 32)
    assert plan.params == count_params(TINY)[0]
    assert plan.flops_per_token == fpt
    assert plan.total_flops == fpt * 8 * 32 * 100
    assert plan.est_hours == pytest.approx(fpt * 25600 / (2.0e12 * 0.25) / 3600)
    assert plan.tokens_per_param == pytest.approx(25600 / plan.params)
    assert plan.device_memory_gb == 8
    assert plan.to_dict()["model"]["n_embd"] == 32


def test_planner_picks_the_largest_micro_batch_that_fits_and_divides() -> None:
    per_rank = 12
    totals = {m: memory_breakdown(TINY, m, 32, False)["total"] for m in range(1, per_rank + 1)}
    memory_gb = totals[5] / 0.8 * 1.0001  # budget (80%) holds micro 5 but not 6
    plan = make_plan(TINY, BatchConfig(seq_len=32, global_batch=per_rank), HardwareConfig(memory_gb=memory_gb))
    assert plan.micro_batch == 4  # 5 fits but does not divide 12
    assert plan.grad_accum == 3
    assert plan.memory_gb["total"] == pytest.approx(totals[4], abs=1e-4)
    # with plenty of memory the whole per-rank batch goes in one pass
    big = make_plan(TINY, BatchConfig(seq_len=32, global_batch=per_rank), HardwareConfig(memory_gb=64))
    assert (big.micro_batch, big.grad_accum) == (12, 1)


def test_global_batch_not_divisible_by_world_names_it() -> None:
    with pytest.raises(PlanError, match=r"batch\.global_batch=30 is not divisible by 4 ranks; use a multiple of 4"):
        make_plan(TINY, BatchConfig(seq_len=32, global_batch=30), HardwareConfig(nproc_per_node=2, nnodes=2, memory_gb=8))


def test_micro_batch_must_divide_per_rank_batch() -> None:
    with pytest.raises(PlanError, match=r"batch\.micro_batch=3 must divide the per-rank batch 8"):
        make_plan(TINY, BatchConfig(seq_len=32, global_batch=16, micro_batch=3), HardwareConfig(nproc_per_node=2, memory_gb=8))


def test_seq_len_longer_than_block_size_is_rejected() -> None:
    with pytest.raises(PlanError, match=r"batch\.seq_len=64 exceeds model\.block_size=32"):
        make_plan(TINY, BatchConfig(seq_len=64, global_batch=8), HardwareConfig(memory_gb=8))


def test_plan_that_cannot_fit_says_what_would() -> None:
    with pytest.raises(PlanError) as err:
        make_plan(GPT2_124M, BatchConfig(seq_len=1024, global_batch=8), HardwareConfig(memory_gb=0.001))
    msg = str(err.value)
    assert "micro_batch=1" in msg  # the planner already shrank the micro-batch to one sequence
    assert "a device has 0.001 GiB" in msg  # small memory is not rounded to a misleading 0.0
    # nothing fits, so the message names the largest model that would: 0.8 * 0.001 GiB / 16 B
    assert re.search(r"at most 0\.0537M parameters per device \(this model has 124M\)", msg), msg
    assert "FSDP" in msg


def test_plan_that_fits_only_shorter_sequences_names_the_longest() -> None:
    with pytest.raises(PlanError) as err:
        make_plan(GPT2_124M, BatchConfig(seq_len=1024, global_batch=8), HardwareConfig(memory_gb=3.0))
    seq = int(re.search(r"fits at micro_batch=1 with seq_len<=(\d+)", str(err.value)).group(1))
    assert 1 < seq < 1024
    # and the suggestion is right: it plans at that length and fails one token later
    batch = BatchConfig(seq_len=seq, global_batch=8)
    assert make_plan(GPT2_124M, batch, HardwareConfig(memory_gb=3.0)).micro_batch == 1
    with pytest.raises(PlanError):
        make_plan(GPT2_124M, BatchConfig(seq_len=seq + 1, global_batch=8), HardwareConfig(memory_gb=3.0))
