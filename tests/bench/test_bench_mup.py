"""bench/bench_mup.py's arithmetic: the lr grid, the best lr per width with diverged runs as inf, how far it moves,
the markdown table's "diverged", the JSON's nulls, and the jobs it gives the trainer."""

import argparse
import math

from bench_module import load_bench

INF = math.inf


def runs(losses: dict) -> list[dict]:
    """{(param, width): [loss per lr exponent -9, -8, -7]} -> bench runs."""
    return [{"param": p, "width": w, "lr_exp": e, "val_loss": x}
            for (p, w), xs in losses.items() for e, x in zip((-9, -8, -7), xs)]


def test_lr_grid_is_a_range_or_a_list_of_exponents():
    bench = load_bench("bench_mup")
    assert bench.lr_exps("-12:-5") == list(range(-12, -4)) and bench.lr_exps("-5:-7") == [-7, -6, -5]
    assert bench.lr_exps("-8,-10") == [-10, -8]


def test_best_lr_skips_diverged_runs_and_its_move_is_counted_in_grid_steps():
    bench = load_bench("bench_mup")
    got = bench.summarise(runs({
        ("sp", 64): [5.0, 4.0, 4.5], ("sp", 256): [4.2, 4.6, INF],  # SP: the best lr falls by one step
        ("mup", 64): [5.0, 4.0, 4.5], ("mup", 256): [4.9, 3.8, INF],
    }), [64, 256], [-9, -8, -7])
    assert got["sp"]["by_width"][256]["best_exp"] == -9 and got["sp"]["shift"] == -1
    assert got["mup"]["by_width"][256]["best_lr"] == 2.0**-8 and got["mup"]["shift"] == 0
    table = bench.tables(got, [64, 256], [-9, -8, -7], 64)
    assert "| 256 | **4.2000** | 4.6000 | diverged | 2^-9 |" in table
    assert "| muP (mup_base_width 64) | 2^-8 | 2^-8 | 0 |" in table
    diverged = runs({(p, w): [INF] * 3 for p in ("sp", "mup") for w in (64, 256)})
    every = bench.summarise(diverged, [64, 256], [-9, -8, -7])
    assert every["sp"]["by_width"][64]["best_exp"] is None and every["sp"]["shift"] is None
    assert bench.finite_or_null({"a": [1.5, INF, float("nan")], "b": (INF,)}) == {"a": [1.5, None, None], "b": [None]}


def test_jobs_differ_only_in_width_parametrisation_and_lr(tmp_path):
    bench = load_bench("bench_mup")
    a = argparse.Namespace(shards=str(tmp_path), family="gpt2", seq_len=128, n_layer=2, n_head=4, base_width=64,
                           warmup=6, weight_decay=0.0, batch=8, steps=60, eval_batches=8, seed=1)
    sp, mup = bench.job_for("sp", 256, -8, a, 4096), bench.job_for("mup", 256, -7, a, 4096)
    assert sp["model"]["mup_base_width"] == 0 and mup["model"]["mup_base_width"] == 64
    assert (sp["optim"]["lr"], mup["optim"]["lr"]) == (2.0**-8, 2.0**-7) and "family" not in sp["model"]
    same = {k for k in sp if k not in ("model", "optim")}
    assert {k: sp[k] for k in same} == {k: mup[k] for k in same} and sp["spikes"] == {"enabled": False}


def test_over_seeds_each_seeds_move_the_mean_curves_best_and_how_sharp_it_is_beside_the_spread():
    bench = load_bench("bench_mup")
    exps = [-9, -8, -7]
    one = bench.summarise(runs({("sp", 64): [5.0, 4.0, 4.5], ("sp", 256): [4.2, 4.6, 5.0],
                                ("mup", 64): [5.0, 4.0, 4.5], ("mup", 256): [4.9, 3.8, 4.0]}), [64, 256], exps)
    two = bench.summarise(runs({("sp", 64): [5.2, 4.2, 4.1], ("sp", 256): [4.4, 4.5, 5.0],
                                ("mup", 64): [5.2, 4.2, 4.1], ("mup", 256): [4.9, 3.9, 4.1]}), [64, 256], exps)
    got = bench.across_seeds({0: one, 1: two}, [64, 256], exps)
    assert got["sp"]["shift_per_seed"] == [-1, -2] and got["sp"]["shift_of_mean"] == -1
    w64 = got["sp"]["by_width"][64]
    assert w64["best_exp_per_seed"] == [-8, -7] and w64["mean_best_exp"] == -8
    assert math.isclose(w64["mean_best_loss"], 4.1) and math.isclose(w64["seed_spread_at_best"], 0.2)
    assert math.isclose(w64["sharpness"], 0.2)  # -7's mean 4.3 is 0.2 above, -9's 5.1 is 1.0 above
    assert got["sp"]["by_width"][256]["sharpness"] is None  # the best lr is the grid's lowest: one side only
    assert got["mup"]["shift_per_seed"] == [0, -1] and got["mup"]["shift_of_mean"] == 0
    table = bench.across_table(got, [64, 256], 64)
    assert "| standard parametrisation | 64 | 2^-8, 2^-7 | 2^-8 | 4.1000 | 0.2000 | 0.2000 |" in table
    assert "| muP (mup_base_width 64) | 0, -1 | 0 |" in table
