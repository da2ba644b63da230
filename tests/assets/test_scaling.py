"""training_plan's decisions from the scaling ladder and the sweep (assets.training.decided, prediction) and the
card's ladder section, on a ladder value made from a known law."""

import math

import pytest

from assets.training import TrainingPlanConfig, decided, prediction
from kiln.common.config import ConfigError
from kiln.release.card import LADDER_PLOT, _scaling, card_figures
from kiln.release.records import CardPlan
from kiln.scaling.ladder import summarize


def law(n, d):
    return 1.8 + 40.0 / n**0.3 + 60.0 / d**0.25


@pytest.fixture(scope="module")
def ladder():
    rows = []
    for c in (1e12, 3e12, 1e13):
        for n in (1e5, 2e5, 4e5, 8e5, 1.6e6):
            d = c / (6 * n)
            rows.append({"rung": f"{n:g}@{c:g}", "params": n, "tokens": d, "budget": c, "loss": law(n, d)})
    return {"rows": rows, "version": "ladder1", **summarize(rows, bootstrap=20)}


def demo_config(**kw):
    return TrainingPlanConfig(model_preset="demo", model={"family": "llama"}, **kw)


def test_sizing_by_law_takes_the_width_and_steps_the_law_finds_optimal(ladder):
    config, notes = decided(demo_config(sizing="law", compute_budget=4e13), 4096, None, None, ladder)
    sized = notes["sized_by_law"]
    assert config.model.n_embd == sized["width"] and config.batch.max_steps == sized["steps"]
    assert config.model.n_layer is None and config.model_preset == "demo"  # the shape stays the named size's
    planned = config.planned(4096)
    made, cfg = planned.single, planned.model
    assert made.params == sized["params"] and cfg.n_layer == 4
    assert abs(made.total_flops / 4e13 - 1) < 0.01  # the steps spend the budget
    assert abs(math.log(sized["params"] / sized["optimal_params"])) < 0.4


def test_sizing_by_law_without_a_ladder_or_with_a_failed_fit_is_refused(ladder):
    with pytest.raises(ConfigError, match="materialize it first"):
        decided(demo_config(sizing="law"), 4096, None, None, None)
    with pytest.raises(ConfigError, match="no usable law"):
        decided(demo_config(sizing="law"), 4096, None, None, {**ladder, "law": {"error": "did not converge"}})
    with pytest.raises(ConfigError, match="choose preset or law"):
        decided(demo_config(sizing="chinchilla"), 4096, None, None, ladder)
    with pytest.raises(ConfigError, match="no sweep_results"):
        decided(demo_config(from_sweep=True), 4096, None, None, None)


def test_from_sweep_takes_the_best_points_model_batch_and_optim_fields():
    best = {"key": "n_embd=128;global_batch=16;lr=0.004", "final_val_loss": 5.1,
            "values": {"model.n_embd": 128, "batch.global_batch": 16, "optim.lr": 0.004}}
    config, notes = decided(demo_config(from_sweep=True), 4096, None, {"best": best, "version": "s1"}, None)
    assert (config.model.n_embd, config.batch.global_batch) == (128, 16)
    assert notes["optim_overrides"] == {"lr": 0.004} and notes["sweep"]["point"] == best["key"]


def test_the_plan_states_the_laws_prediction_and_the_card_compares_it(ladder):
    config, _ = decided(demo_config(), 4096, None, None, ladder)
    made = config.planned(4096).single
    plan = {**made.to_dict(), "hardware": {"device": "cpu", "nproc_per_node": 1}, "max_steps": 700}
    got = prediction(plan, ladder, "preset")
    assert got["predicted_val_loss"] == pytest.approx(law(plan["params"], plan["total_tokens"]), rel=0.01)
    assert got["interval"][0] <= got["predicted_val_loss"] <= got["interval"][1]
    n_opt, d_opt = got["optimal"]["params"], got["optimal"]["tokens"]  # the law's split of the same 6ND budget
    assert abs(6 * n_opt * d_opt / (6 * plan["params"] * plan["total_tokens"]) - 1) < 1e-6
    assert law(n_opt, d_opt) <= law(plan["params"], plan["total_tokens"]) + 0.01
    assert prediction(plan, {**ladder, "law": {"error": "x"}}, "preset") is None
    plan["scaling"] = got
    base = {"final_val_loss": got["predicted_val_loss"] * 1.01, "history": [], "curve": []}
    text = _scaling(CardPlan.from_dict(plan), base["final_val_loss"], {LADDER_PLOT: b"png"})
    assert "## Scaling ladder" in text and "(+1.00%)" in text and f"]({LADDER_PLOT})" in text
    assert "| alpha | 0.3" in text and "| 0.34 |" in text  # fitted beside Chinchilla's
    assert LADDER_PLOT in card_figures({"base_model": base, "training_plan": plan})


def test_the_ladders_default_shape_reaches_the_launchpad_as_the_demos_llama():
    """A default the launchpad cannot see is lost when Dagster fills the config: the ladder would train GPT-2s."""
    from jobs.definitions import defs

    schema = defs.resolve_job_def("kiln_pipeline_job").run_config_schema.config_type
    block = schema.fields["ops"].config_type.fields["scaling_ladder"].config_type.fields["config"].config_type
    assert block.fields["model"].default_value["family"] == "llama"
    assert block.fields["model_preset"].default_value == "demo"
    assert block.fields["widths"].default_value == [16, 24, 32, 48, 64, 80, 96]
