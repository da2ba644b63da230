"""kiln.scaling.ladder: the ladder's runs for its budgets, the fits of their losses, and a size from the law."""

import math

import pytest

from kiln.common.config import ConfigError
from kiln.scaling.ladder import design, law_of, size_for, summarize

DEMO_SHAPE = dict(family="llama", n_layer=4, n_head=4, n_kv_head=2, block_size=256)


def test_each_budget_gets_the_steps_it_buys_and_short_or_long_runs_are_left_out():
    rungs, skipped = design(DEMO_SHAPE, [32, 48, 64, 80, 96], [1e12, 2.5e12, 6e12], n_vocab=4096, seq_len=256,
                            tokens_per_step=2048, min_steps=100, max_tokens=3.2e6)
    by = {r.name: r for r in rungs}
    w64 = by["w64@2.5e+12"]
    assert w64.params == 459_328  # the demo's shape at width 64 with a 4,096-token vocabulary, head tied
    assert w64.steps == round(2.5e12 / w64.flops_per_token / 2048)
    assert abs(w64.flops / 2.5e12 - 1) < 0.01  # whole steps spend the budget within half a step
    assert {s["rung"]: s["why"] for s in skipped} == {"w96@1e+12": "82 steps < min_steps 100",
                                                      "w32@6e+12": "3,874,816 tokens > the 3,200,000 allowed (max_epochs)"}
    assert max(r.params for r in rungs) < 1_000_000
    assert len(rungs) == 13


def test_a_ladder_that_does_not_fit_its_budgets_says_what_each_width_needs():
    with pytest.raises(ConfigError, match=r"budget 1e\+14 keeps 0 width\(s\): w32@1e\+14 .* tokens > the"):
        design(DEMO_SHAPE, [32, 48, 64], [1e12, 1e14], 4096, 256, 2048, 100, 3.2e6)
    with pytest.raises(ConfigError, match="at least three different widths"):
        design(DEMO_SHAPE, [32, 64], [1e12, 2e12], 4096, 256, 2048, 100, 3.2e6)
    with pytest.raises(ConfigError, match="at least two different positive budgets"):
        design(DEMO_SHAPE, [32, 48, 64], [1e12], 4096, 256, 2048, 100, 3.2e6)
    with pytest.raises(ConfigError, match="width 30"):  # 4 heads do not divide 30
        design(DEMO_SHAPE, [30, 48, 64], [1e12, 2e12], 4096, 256, 2048, 100, 3.2e6)


def law(n, d):
    return 2.0 + 300.0 / n**0.35 + 800.0 / d**0.3


def synthetic_rows(noise: float = 0.003):
    import random

    rng, rows = random.Random(0), []
    for c in (1e12, 3e12, 1e13):
        for n in (1.5e4, 3e4, 6e4, 1.2e5, 2.4e5, 4.8e5):
            d = c / (6 * n)
            rows.append({"rung": f"{n:g}@{c:g}", "params": n, "tokens": d, "budget": c,
                         "loss": law(n, d) * (1 + rng.gauss(0, noise))})
    return rows


def test_summary_fits_both_approaches_and_the_law_reloads_with_its_interval():
    fits = summarize(synthetic_rows(), bootstrap=30)
    assert fits["points"] == 18
    got = fits["law"]
    assert "error" not in got and abs(got["alpha"] - 0.35) < 0.1 and abs(got["beta"] - 0.3) < 0.1
    assert fits["isoflop"]["budgets_used"] == 3 and abs(fits["isoflop"]["a"] - 0.3 / 0.65) < 0.05
    fit = law_of({"law": got, "version": "v"})
    assert abs(fit.predict(4e6, 1.4e6) / law(4e6, 1.4e6) - 1) < 0.02  # 8x past the largest size
    low, high = fit.interval(4e6, 1.4e6)
    assert low <= law(4e6, 1.4e6) <= high and high - low < 0.1 * law(4e6, 1.4e6)


def test_no_ladder_or_a_failed_fit_is_a_config_error():
    with pytest.raises(ConfigError, match="materialize it first"):
        law_of(None)
    with pytest.raises(ConfigError, match="no usable law .*too few"):
        law_of({"law": {"error": "too few points"}, "version": "v"})


def test_a_diverged_rung_is_left_out_of_the_fits():
    rows = synthetic_rows()
    rows[0]["loss"] = math.nan
    assert summarize(rows, bootstrap=0)["points"] == 17


def test_size_for_picks_the_width_nearest_the_laws_optimum():
    fit = law_of({"law": summarize(synthetic_rows(), bootstrap=0)["law"], "version": "v"})
    sized = size_for(fit.optimal, 3.9e13, DEMO_SHAPE, n_vocab=4096, seq_len=256, tokens_per_step=2048)
    assert sized["width"] % 32 == 0
    assert abs(math.log(sized["params"] / sized["optimal_params"])) < 0.35  # the nearest width, within one step
    assert sized["steps"] * 2048 == sized["tokens"]
    assert abs(sized["tokens"] * sized["flops_per_token"] / 3.9e13 - 1) < 0.01  # the steps spend the budget


def test_a_law_the_points_cannot_pin_down_is_marked_with_the_points():
    rows = [{"rung": f"r{i}", "params": 1e5 * (i % 3 + 1), "tokens": 1e6 * (i // 3 + 1), "budget": float(i // 3 + 1),
             "loss": 5.0} for i in range(6)]  # no loss falls with size or data: no exponent fits
    law = summarize(rows, bootstrap=0)["law"]
    assert "did not converge" in law["error"] and "r5 (N=3e+05, D=2e+06, C=2, loss=5)" in law["error"]
    with pytest.raises(ConfigError, match="no usable law"):
        law_of({"law": law, "version": "v"})
