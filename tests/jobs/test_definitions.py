"""The Definitions load, and every asset carries what the UI and staleness checks need."""

from dagster import AssetKey

from jobs.definitions import ALL_ASSETS, defs

EXPECTED = {"pretrained_model", "raw_documents", "clean_corpus", "tokenizer", "token_shards", "training_plan", "base_model",
            "eval_suite", "contamination_report", "eval_scores", "checkpoint_evals", "benchmark_matrix", "instruction_data",
            "preference_data", "sft_model", "dpo_model", "rl_model", "judged_preferences", "reward_model", "ppo_model", "red_team_report",
            "release_bundle",
            "scaling_ladder", "sweep_grid", "sweep", "sweep_results", "ablation_grid", "ablation", "ablation_report"}


def test_definitions_load_with_every_asset():
    graph = defs.resolve_asset_graph()
    assert {k.to_user_string() for k in graph.get_all_asset_keys()} == EXPECTED
    assert defs.resolve_job_def("kiln_pipeline_job") is not None
    assert defs.resolve_schedule_def("nightly_eval_schedule").cron_schedule == "0 2 * * *"


def test_assets_have_docstrings_and_code_versions():
    for a in ALL_ASSETS:
        spec = a.specs_by_key[a.key]
        assert spec.description and len(spec.description) > 40, a.key
        assert spec.code_version, a.key


def test_lineage_edges():
    graph = defs.resolve_asset_graph()
    parents = lambda k: {p.to_user_string() for p in graph.get(AssetKey(k)).parent_keys}  # noqa: E731
    assert parents("clean_corpus") == {"raw_documents"}
    assert parents("token_shards") == {"clean_corpus", "tokenizer"}
    assert {"scaling_ladder", "sweep_results", "tokenizer", "token_shards"} <= parents("training_plan")
    assert parents("sweep") == {"sweep_grid"} and parents("sweep_results") == {"sweep_grid", "sweep"}
    assert parents("ablation_grid") == {"raw_documents", "tokenizer"} and parents("ablation") == {"ablation_grid"}
    assert parents("ablation_report") == {"ablation_grid", "ablation"}
    assert parents("tokenizer") == {"clean_corpus", "pretrained_model"}  # released weights -> tokenizer, plan -> base
    assert "pretrained_model" in parents("training_plan") and "training_plan" in parents("base_model")
    assert {"training_plan", "token_shards", "tokenizer"} <= parents("base_model")
    assert {"base_model", "instruction_data"} <= parents("sft_model")
    assert {"sft_model", "preference_data"} <= parents("dpo_model")
    assert {"dpo_model", "instruction_data"} <= parents("rl_model")
    assert "rl_model" in parents("release_bundle")  # the release takes the last post-training stage
    assert {"sft_model", "eval_scores", "raw_documents"} <= parents("release_bundle")
    assert {"sft_model", "preference_data"} <= parents("reward_model")
    assert {"sft_model", "reward_model", "instruction_data"} <= parents("ppo_model")
    assert "ppo_model" in parents("release_bundle")  # released instead of rl_model when release_bundle.stage says so
    assert {"sft_model", "preference_data", "instruction_data"} <= parents("judged_preferences")
    assert "judged_preferences" in parents("release_bundle")  # optional: the card and lineage report the judge
    # optional: read when their feedback is judged or mixed (the AI judge's pairs train them)
    assert "judged_preferences" in parents("dpo_model") and "judged_preferences" in parents("reward_model")
    assert {"sft_model", "dpo_model", "rl_model", "ppo_model"} == parents("red_team_report")  # every stage answers it
    assert "red_team_report" in parents("release_bundle")  # the red-team gate reads the released stage's rates


def test_every_preset_is_valid_run_config():
    import pytest
    from dagster import validate_run_config

    from jobs.presets import PRESETS, load_preset

    job = defs.resolve_job_def("kiln_pipeline_job")
    names = sorted(p.stem for p in PRESETS.glob("*.yaml"))
    assert {"smoke", "demo", "gpt2-124m-1gpu", "gpt2-124m-8gpu"} <= set(names)
    for name in names:
        validate_run_config(job, load_preset(name))
    with pytest.raises(Exception, match="tokenizr"):
        validate_run_config(job, {"ops": {"tokenizr": {"config": {}}}})
    for name in names:  # a preset's sweep blocks are kiln sweep's: valid for the sweep's own jobs
        ops = load_preset(name, sweep=True).get("ops", {})
        for op in ("sweep_grid", "sweep_results", "ablation_grid", "ablation_report"):
            if op in ops:
                validate_run_config(defs.resolve_job_def(f"{op}_job"), {"ops": {op: ops[op]}})
    assert "sweep_grid" in load_preset("sweep-demo", sweep=True)["ops"] and "sweep_grid" not in load_preset("sweep-demo")["ops"]
    assert "ablation_grid" in load_preset("ablation-demo", sweep=True)["ops"]
    assert "ablation_grid" not in load_preset("ablation-demo")["ops"]


def test_gpu_preset_8gpu_differs_only_in_hardware():
    from jobs.presets import load_preset

    one, eight = load_preset("gpt2-124m-1gpu"), load_preset("gpt2-124m-8gpu")
    hw = lambda p: p["ops"]["training_plan"]["config"].pop("hardware")  # noqa: E731
    assert hw(one)["nproc_per_node"] == 1 and hw(eight)["nproc_per_node"] == 8
    assert one == eight


def test_a_partial_resource_block_keeps_the_bound_values_it_leaves_out(tmp_path):
    from dagster import asset, materialize

    from jobs.definitions import complete_resource_config, make_resources
    from resources.tracking import MlflowResource

    bound = make_resources(tmp_path / "home", str(tmp_path / "cache"))
    config = complete_resource_config({"ops": {}, "resources": {"mlflow": {"config": {"reuse_runs": False}}}}, bound)
    seen = {}

    @asset
    def probe(mlflow: MlflowResource) -> None:
        seen.update(mlflow.model_dump())

    assert materialize([probe], resources={"mlflow": bound["mlflow"]}, run_config=config).success
    assert seen["reuse_runs"] is False
    assert seen["tracking_uri"] == f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}"  # not the class default
    assert seen["artifact_root"] == str(tmp_path / "home" / "mlartifacts")
    assert complete_resource_config({"ops": {}}, bound) == {"ops": {}}


def launchpad_defaults(home) -> dict:
    """The run config kiln_pipeline_job's launchpad opens with, as the Dagster UI computes it (rootDefaultYaml)."""
    import yaml
    from dagster._core.snap import JobSnap
    from dagster_graphql.schema.run_config import default_values_yaml_from_type_snap

    from jobs.definitions import make_definitions

    snap = JobSnap.from_job_def(make_definitions(home, launchpad=True).resolve_job_def("kiln_pipeline_job"))
    root = snap.config_schema_snapshot.get_config_snap(snap.mode_def_snaps[0].root_config_key)
    return yaml.safe_load(default_values_yaml_from_type_snap(snap.config_schema_snapshot, root))


def test_the_launchpad_opens_with_the_preset_of_the_homes_latest_kiln_run(tmp_path, capsys):
    from jobs.presets import load_preset
    from jobs.home import PRESET_RECORD, record_preset

    plain = launchpad_defaults(tmp_path)  # nothing recorded: the class defaults (no model preset: GPT-2)
    assert plain["ops"]["training_plan"]["config"]["model_preset"] == "" and "model" not in plain["ops"]["training_plan"]["config"]
    preset = load_preset("llama-tiny")
    record_preset(tmp_path, "llama-tiny", preset)
    ops = launchpad_defaults(tmp_path)["ops"]
    for op, block in preset["ops"].items():
        for field, value in block["config"].items():
            if isinstance(value, dict):  # nested blocks: the preset's fields, the rest at their defaults
                assert {k: ops[op]["config"][field][k] for k in value} == value, (op, field)
            else:
                assert ops[op]["config"][field] == value, (op, field)
    assert ops["training_plan"]["config"]["model"]["family"] == "llama" and ops["training_plan"]["config"]["model_preset"] == "tiny"
    # A record the schema no longer takes (a field renamed since) or cannot read: the defaults, and why.
    (tmp_path / PRESET_RECORD).write_text('{"preset": "old", "ops": {"training_plan": {"config": {"no_such_field": 1}}}}')
    assert launchpad_defaults(tmp_path) == plain
    assert "preset old recorded in" in capsys.readouterr().err
    (tmp_path / PRESET_RECORD).write_text("{not json")
    assert launchpad_defaults(tmp_path) == plain
    assert "is unreadable" in capsys.readouterr().err
