"""``kiln status``'s config diff. Its predictions against real smoke materializations are checked in
tests/test_e2e.py, before each of that suite's reruns, against what the rerun recomputed.

Run: python -m pytest -q tests/jobs/test_status.py
"""

from jobs.status import config_changes


def test_config_changes_name_the_field_with_old_and_new_value():
    assert config_changes({"clean": {"min_words": 50, "x": 1}}, {"clean": {"min_words": 80, "x": 1}}) == [
        "config clean.min_words 50 -> 80"]
    assert config_changes({"tasks": []}, {"tasks": ["a"]}) == ['config tasks [] -> ["a"]']


def test_status_skips_the_opt_in_assets_run_leaves_out_and_says_what_it_cannot_estimate():
    """kiln status and kiln run pick assets through one run_selection: the demo preset's opt-in assets (judged
    preferences, reward model, PPO) are "skip" in status, not "compute", and not counted as assets that would run;
    an asset never run has no estimate, which the total says instead of adding 0 s."""
    from jobs.presets import load_preset, run_selection
    from jobs.definitions import ALL_ASSETS, OPT_IN
    from jobs.status import AssetStatus, format_status

    names = [a.key.to_user_string() for a in ALL_ASSETS]
    demo = run_selection(names, load_preset("demo", keep_opt_in=True).get("opt_in") or [])
    assert set(names) - set(demo) == set(OPT_IN) and run_selection(names, ["reward_model"]) == [
        n for n in names if n not in ("scaling_ladder", "judged_preferences", "ppo_model")]
    assert run_selection(names, [], "base_model, tokenizer") == ["base_model", "tokenizer"]
    rows = [AssetStatus("tokenizer", "abc", "2026-12-01T10:00:00+00:00", "reuse", ["unchanged"], 0.0, "reuse"),
            AssetStatus("base_model", None, None, "compute", ["never materialized"], None, ""),
            AssetStatus("eval_scores", "def", "2026-12-01T10:00:00+00:00", "recompute", ["config"], 12.0, "last run"),
            AssetStatus("reward_model", None, None, "skip", ["opt-in: the preset's opt_in does not list it"])]
    text = format_status(rows)
    assert "base_model            -                 -                    compute    unknown" in text
    assert text.splitlines()[-1] == ("2 of 3 assets would run, about 12s plus base_model (never run: no estimate) (from "
                                     "the last runs' durations); one below a change is reused after all when its inputs "
                                     "come out byte-identical; 1 opt-in assets not selected")
    assert format_status([rows[0], rows[3]]).splitlines()[-1] == ("nothing to run: all 1 assets would be reused; 1 "
                                                                 "opt-in assets not selected")


def test_an_optional_input_the_next_config_leaves_unread_does_not_make_an_asset_run():
    """dpo_model and reward_model read judged_preferences only with feedback judged or mixed: with checkable, a new
    judge (or judged_preferences never run) is no reason to train them again, as their run keys leave it out."""
    from jobs.definitions import defs
    from jobs.status import StatusReader

    reader = StatusReader.__new__(StatusReader)  # the graph and the next config are all parents() reads
    reader.graph = defs.resolve_asset_graph()
    reader.new_ops = {"dpo_model": {"feedback": "checkable"}, "reward_model": {"feedback": "mixed"}}
    assert "judged_preferences" not in reader.parents("dpo_model")
    assert {"sft_model", "preference_data"} <= set(reader.parents("dpo_model"))
    assert "judged_preferences" in reader.parents("reward_model")
    reader.new_ops = {"dpo_model": {"feedback": "judged"}}
    assert "judged_preferences" in reader.parents("dpo_model") and "judged_preferences" not in reader.parents("reward_model")
    assert "judged_preferences" in reader.parents("release_bundle")  # read whatever its config says
