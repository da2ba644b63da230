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
    assert r["warmup_s"] >= 0.0


def test_compare_reads_kilns_time_to_nanogpts_final_loss():
    bench = load_bench("bench_nanogpt")
    kiln = {"curve": [(0, 0, 0.0, 8.0), (10, 100, 5.0, 6.0), (20, 200, 10.0, 4.0)], "tokens_per_s": 20.0,
            "final_val_loss": 4.0, "warmup_s": 2.5}
    nano = {"final_val_loss": 5.0, "train_s": 30.0, "tokens_per_s": 25.0, "warmup_s": 0.0}
    cmp = bench.compare(kiln, nano)
    assert cmp["kiln_time_to_target_s"] == pytest.approx(7.5) and cmp["kiln_tokens_to_target"] == pytest.approx(150)
    assert cmp["time_to_loss_ratio"] == pytest.approx(4.0)
    assert cmp["time_to_loss_ratio_with_warmup"] == pytest.approx(30 / (7.5 + 2.5))  # a compile's seconds count
    assert cmp["tokens_per_s_ratio"] == pytest.approx(0.8) and cmp["loss_gap_at_equal_tokens"] == pytest.approx(1.0)
    assert bench.compare(kiln, {**nano, "final_val_loss": 5.5})["time_to_loss_ratio"] == pytest.approx(30 / 6.25)
    assert bench.compare(kiln, {**nano, "final_val_loss": 3.0})["time_to_loss_ratio"] is None


def test_compare_with_turns_pairs_each_rounds_speeds_and_scales_the_tokens_ratio_by_their_median():
    bench = load_bench("bench_nanogpt")
    kiln = {"curve": [(0, 0, 0.0, 8.0), (10, 100, 5.0, 6.0), (20, 200, 10.0, 4.0)], "tokens_per_s": 20.0,
            "final_val_loss": 4.0, "warmup_s": 0.0}
    nano = {"final_val_loss": 5.0, "train_s": 30.0, "tokens_per_s": 25.0, "warmup_s": 0.0,
            "curve": [(0, 0, 0.0, 9.0), (30, 600, 30.0, 5.0)]}
    # rounds: nanoGPT's step over Kiln's = 2.0, 1.5, 1.2 (each round paired, not the ratio of the medians: 1.5 / 1.0)
    cmp = bench.compare(kiln, nano, [1.0, 1.0, 0.5], [2.0, 1.5, 0.6])
    assert cmp["kiln_tokens_to_target"] == pytest.approx(150) and cmp["tokens_ratio"] == pytest.approx(4.0)
    assert cmp["turns_tokens_per_s_ratio"] == pytest.approx(1.5)
    assert cmp["turns_time_to_loss_ratio"] == pytest.approx(6.0)
    assert cmp["time_to_loss_ratio"] == pytest.approx(4.0)  # the long runs' own figure is kept beside it
    assert "turns_tokens_per_s_ratio" not in bench.compare(kiln, nano)
    missed = bench.compare(kiln, {**nano, "final_val_loss": 3.0}, [1.0], [2.0])
    assert missed["turns_tokens_per_s_ratio"] == 2.0 and missed["turns_time_to_loss_ratio"] is None


def test_take_turns_runs_every_arm_once_a_round_in_rotating_order(tiny_shards, monkeypatch):
    bench = load_bench("bench_nanogpt")
    order = []
    monkeypatch.setattr(bench.speedrun, "run", lambda recipe, shards, steps, every, label: (
        order.append(label), {"step_s": recipe["s"]})[1])
    monkeypatch.setattr(bench, "run_nanogpt", lambda shards, seed, every, c: (
        order.append(f"nanoGPT {c['max_iters']} {c['warmup_iters']}"), {"step_s": 0.3})[1])
    turns = bench.take_turns({"a": {"s": 0.1}, "b": {"s": 0.2}}, tiny_shards, 3, 20)
    assert order == ["a", "b", "nanoGPT 20 20", "b", "nanoGPT 20 20", "a", "nanoGPT 20 20", "a", "b"]
    assert turns == {"a": [0.1] * 3, "b": [0.2] * 3, "nanoGPT": [0.3] * 3}


def test_a_tiny_nanogpt_takes_its_turns_in_short_runs(tiny_shards):
    bench = load_bench("bench_nanogpt")
    tiny = {**bench.NANOGPT, "n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 8}
    turns = bench.take_turns({}, tiny_shards, 2, 6, tiny)
    assert list(turns) == ["nanoGPT"] and len(turns["nanoGPT"]) == 2 and all(s > 0 for s in turns["nanoGPT"])
