"""bench/bench_nanogpt.py: nanoGPT's schedule and model as its recipe defines them, a tiny run through the worker, and
the side-by-side arithmetic."""

import math

import pytest
from bench_module import load_bench


def test_the_learning_rate_follows_nanogpts_warmup_then_cosine_to_min_lr():
    bench = load_bench("bench_nanogpt")
    c = bench.NANOGPT
    assert bench.nanogpt_lr(0, c) == pytest.approx(1e-3 / 101)
    assert bench.nanogpt_lr(99, c) == pytest.approx(1e-3 * 100 / 101)
    assert bench.nanogpt_lr(100, c) == pytest.approx(1e-3)  # the cosine's start
    assert bench.nanogpt_lr(400, c) == pytest.approx(1e-4 + 0.5 * 0.9e-3)  # half way: the mean of lr and min_lr
    assert bench.nanogpt_lr(700, c) == pytest.approx(1e-4)
    assert bench.nanogpt_lr(701, c) == 1e-4


def test_the_model_ties_its_head_and_scales_the_residual_projections():
    import torch

    bench = load_bench("bench_nanogpt")
    torch.manual_seed(0)
    c = {**bench.NANOGPT, "n_layer": 8, "n_embd": 64, "n_head": 4, "block_size": 16}
    model = bench.nanogpt_model(1024, c)
    assert model.lm_head.weight is model.wte.weight
    assert all(p.dim() >= 2 for n, p in model.named_parameters() if "ln" not in n)  # bias=False: no vectors but norms
    proj = torch.cat([b.mlp_proj.weight.flatten() for b in model.blocks])
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert model.blocks[0].c_fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 1024)


def test_a_tiny_nanogpt_runs_in_its_own_process_and_its_validation_loss_falls(tiny_shards):
    bench = load_bench("bench_nanogpt")
    tiny = {**bench.NANOGPT, "n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 8,
            "warmup_iters": 2, "max_iters": 12, "lr_decay_iters": 12, "learning_rate": 3e-3}
    r = bench.run_nanogpt(tiny_shards, 0, 4, tiny)
    assert [c[0] for c in r["curve"]] == [0, 4, 8, 12]
    assert r["curve"][-1][3] < r["curve"][0][3] - 0.3
    assert r["tokens_per_s"] == pytest.approx(8 * 32 / r["step_s"])
    assert r["train_s"] == pytest.approx(12 * r["step_s"])


def test_compare_reads_kilns_time_to_nanogpts_final_loss():
    bench = load_bench("bench_nanogpt")
    kiln = {"curve": [(0, 0, 0.0, 8.0), (10, 100, 5.0, 6.0), (20, 200, 10.0, 4.0)], "tokens_per_s": 20.0,
            "final_val_loss": 4.0}
    nano = {"final_val_loss": 5.0, "train_s": 30.0, "tokens_per_s": 25.0}
    cmp = bench.compare(kiln, nano)
    assert cmp["kiln_time_to_target_s"] == pytest.approx(7.5) and cmp["kiln_tokens_to_target"] == pytest.approx(150)
    assert cmp["time_to_loss_ratio"] == pytest.approx(4.0)
    assert cmp["tokens_per_s_ratio"] == pytest.approx(0.8) and cmp["loss_gap_at_equal_tokens"] == pytest.approx(1.0)
    assert bench.compare(kiln, {**nano, "final_val_loss": 5.5})["time_to_loss_ratio"] == pytest.approx(30 / 6.25)
    assert bench.compare(kiln, {**nano, "final_val_loss": 3.0})["time_to_loss_ratio"] is None
