"""bench/bench_rl_variants.py: the preset each variant runs, its row from rl_model's before/after and the gate, the
table, and the refusals of bad arguments."""

import pytest
from bench_module import load_bench

from jobs.presets import load_preset


def test_a_variant_is_the_preset_with_its_fields_as_rl_models_config(tmp_path):
    bench = load_bench("bench_rl_variants")
    ops = load_preset(str(bench.preset_file(tmp_path, "demo", "replay", {"preference_coef": 0.1, "seed": 1})))["ops"]
    assert ops["rl_model"]["config"] == {"preference_coef": 0.1, "seed": 1}
    assert ops["raw_documents"]["config"]["manifest"] == "conf/sources/demo.yaml"  # the demo underneath


def row(measure, before, after, se):
    return {"measure": measure, "before": before, "after": after, "change": after - before, "stderr": se,
            "z": (after - before) / se}


def test_the_row_and_table_give_each_change_with_its_z_and_only_the_stages_own_refusals():
    bench = load_bench("bench_rl_variants")
    history = [{"step": i, "rollout_s": 0.4 + 0.1 * i, "rollout_tokens_per_s": 2000.0 + i} for i in range(1, 4)]
    rl = {"steps": 120, "wall_s": 250.4, "goodput": {"productive_s": 240.0}, "history": history, "before_after": [
        row("arithmetic_exact_match", 0.030, 0.084, 0.021), row("preference_margin", 13.8, 13.5, 0.1),
        row("arithmetic_answer_logprob", -4.13, -4.07, 0.11), row("response_loss", 2.47, 2.45, 0.01)]}
    refused = ["rl_model made preference_margin worse than dpo_model, beyond noise (2 paired SE): 13.8 -> 13.5",
               "released.response_loss: 2.4 -> 2.45 (lower is better)"]
    r = bench.result("kl", {"kl_coef": 0.3}, rl, refused)
    assert r["gate"] == ["margin"] and r["steps"] == 120 and r["step_s"] == 2.0
    assert r["rollout_s"] == pytest.approx(0.6) and r["rollout_tokens_per_s"] == 2002.0  # the medians over the steps
    assert r["arithmetic_exact_match"]["z"] == pytest.approx(0.054 / 0.021)
    lines = bench.table([r, bench.result("plain", {}, rl, [])]).splitlines()
    assert lines[2] == ('| kl | `{"kl_coef": 0.3}` | 0.030 -> 0.084 | +0.054 ± 0.021 | **2.57** | -0.300 (-3.00) | '
                        '+0.060 (0.55) | refused: margin | 250 s | 2.00 s | 0.600 s, 2,002 |')
    assert lines[3].endswith("| passes | 250 s | 2.00 s | 0.600 s, 2,002 |")
    older = bench.result("old", {}, {**rl, "history": [{"step": 1}]}, [])  # a run from before rollouts were timed
    assert older["rollout_s"] is None and bench.table([older]).splitlines()[2].endswith("| 2.00 s | - |")


def test_bad_arguments_are_refused_naming_them(tmp_path):
    bench = load_bench("bench_rl_variants")
    with pytest.raises(SystemExit, match="not JSON"):
        bench.main(["--home", str(tmp_path), "--variant", "x={kl: 1}"])
    with pytest.raises(SystemExit, match="no dpo_model here; materialize the preset first"):
        bench.main(["--home", str(tmp_path), "--variant", "x={}"])


def test_the_spread_over_variants_counts_those_beyond_noise_and_those_the_gate_passed():
    bench = load_bench("bench_rl_variants")
    rl = lambda after: {"steps": 120, "wall_s": 200.0, "goodput": {"productive_s": 190.0}, "history": [],  # noqa: E731
                        "before_after": [
        row("arithmetic_exact_match", 0.030, after, 0.02), row("preference_margin", 13.8, 13.9, 0.1),
        row("arithmetic_answer_logprob", -4.1, -4.0, 0.1), row("response_loss", 2.47, 2.45, 0.01)]}
    rows = [bench.result("s3", {"seed": 3}, rl(0.090), []), bench.result("s4", {"seed": 4}, rl(0.050), []),
            bench.result("s5", {"seed": 5}, rl(0.070), ["rl_model made preference_margin worse than dpo_model, x"])]
    assert bench.spread(rows) == ["Held-out exact match change over the 3 variants: mean +0.040, +0.020 .. +0.060; "
                                  "beyond noise (|z| >= 2) in 2 of 3; the stage gate passed 2 of 3."]
