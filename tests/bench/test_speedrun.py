"""bench/speedrun.py's arithmetic: time to a target loss, loss at a time, and a recipe run through the real trainer."""

import numpy as np
import pytest
from bench_module import load_bench as load_module


def load_bench():
    return load_module("speedrun")


CURVE = [(0, 0, 0.0, 8.0), (10, 1000, 5.0, 6.0), (20, 2000, 10.0, 5.0), (30, 3000, 15.0, 4.5)]


def test_time_to_target_interpolates_between_the_evaluations_that_bracket_it():
    bench = load_bench()
    assert bench.time_to(CURVE, 5.5) == pytest.approx((7.5, 1500.0))
    assert bench.time_to(CURVE, 6.0) == pytest.approx((5.0, 1000.0))
    assert bench.time_to(CURVE, 4.0) is None  # never reached


def test_warmup_seconds_is_what_the_first_two_steps_took_beyond_two_median_steps():
    bench = load_bench()
    assert bench.warmup_seconds({0: 0.0, 1: 30.0, 2: 30.5, 3: 31.0, 4: 31.5}, 0.5) == pytest.approx(29.5)
    assert bench.warmup_seconds({0: 0.0, 1: 0.4, 2: 0.8, 3: 1.3}, 0.5) == 0.0  # faster than the median: none
    assert bench.warmup_seconds({0: 0.0, 1: 0.5}, 0.5) == 0.0


def test_loss_at_reads_the_curve_linearly_in_time():
    bench = load_bench()
    assert bench.loss_at(CURVE, 12.5) == pytest.approx(4.75)
    assert bench.loss_at(CURVE, 0.0) == 8.0


def test_levers_change_only_what_they_name():
    bench = load_bench()
    from kiln.train.recipe import BASELINE_RECIPE, merge

    muon = merge(BASELINE_RECIPE, bench.LEVERS["muon"])
    assert muon["optim"] == {**BASELINE_RECIPE["optim"], "name": "muon"} and muon["model"] == BASELINE_RECIPE["model"]
    assert BASELINE_RECIPE["optim"]["name"] == "adamw"  # merge copies: the baseline is untouched


def test_a_recipe_runs_through_the_trainer_and_its_curve_falls(tiny_shards):
    bench = load_bench()
    from kiln.train.recipe import merge

    tiny = {"model": {"family": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32},
            "optim": {"name": "muon", "lr": 3e-3, "warmup_steps": 2, "schedule": "wsd"},
            "seq_len": 32, "micro_batch": 8, "max_steps": 12, "layout": "threads"}
    r = bench.run(merge(tiny, {}), tiny_shards, 12, 4, "tiny")
    assert [c[0] for c in r["curve"]] == [0, 4, 8, 12]
    assert r["curve"][-1][3] < r["curve"][0][3] - 0.3
    assert r["step_s"] > 0 and r["train_s"] == pytest.approx(12 * r["step_s"])
    assert np.isfinite(r["flops_per_token"]) and r["params"] > 0


def test_the_document_mask_lever_and_default_plus_mask_reach_the_job(tmp_path, tiny_shards):
    bench = load_bench()
    from kiln.train.recipe import BASELINE_RECIPE, demo_recipe

    lever = dict(bench.variants())["document mask"]
    assert lever == {**BASELINE_RECIPE, "document_mask": True}
    assert bench.job_for(lever, tiny_shards, tmp_path, 10, 5)["document_mask"] is True
    assert bench.job_for(BASELINE_RECIPE, tiny_shards, tmp_path, 10, 5)["document_mask"] is False
    picked = bench.variants("default,default + document mask")
    assert [label for label, _ in picked] == ["default", "default + document mask"]
    assert picked[1][1] == {**demo_recipe(), "document_mask": True} and picked[0][1] == demo_recipe()
    with pytest.raises(SystemExit, match=r"\['default \+ mask'\]: not a recipe.*'default \+ document mask'\]"):
        bench.variants("default + mask")


@pytest.mark.slow
def test_a_masked_recipe_runs_and_reports_the_cross_document_loss(tiny_shards):
    bench = load_bench()

    tiny = {"model": {"family": "llama", "n_layer": 1, "n_head": 2, "n_kv_head": 1, "n_embd": 32, "block_size": 32,
                      "bias": False},
            "optim": {"name": "adamw", "lr": 3e-3, "warmup_steps": 2}, "seq_len": 32, "micro_batch": 8,
            "max_steps": 8, "layout": "threads", "document_mask": True}
    r = bench.run(tiny, tiny_shards, 8, 4, "tiny masked")
    assert [c[0] for c in r["curve"]] == [0, 4, 8] and r["curve"][-1][3] < r["curve"][0][3]
    assert r["final_val_loss_unmasked"] is not None and abs(r["final_val_loss_unmasked"] - r["final_val_loss"]) > 1e-6
