"""``kiln status`` against real smoke materializations: the e2e suite's stale-only scenarios predicted before a run.

Run: python -m pytest -q tests/jobs/test_status.py   (slow: one smoke run, the e2e suite's own fixture)
"""

from pathlib import Path

import pytest

from jobs.definitions import ALL_ASSETS
from jobs.status import StatusReader, config_changes, format_status, status_json
from test_e2e import computed_assets, downstream_of, rerun, smoke_ops, smoke_run  # noqa: F401 (smoke_run: fixture)

NAMES = [a.key.to_user_string() for a in ALL_ASSETS]


def status(smoke_run, ops: dict) -> dict:
    _, defs, instance, _ = smoke_run
    rows = StatusReader(defs, instance, {"ops": ops}, defs.resources["mlflow"]).status(NAMES)
    return {r.asset: r for r in rows}


def running(rows: dict) -> set[str]:
    return {n for n, r in rows.items() if r.action != "reuse"}


def test_config_changes_name_the_field_with_old_and_new_value():
    assert config_changes({"clean": {"min_words": 50, "x": 1}}, {"clean": {"min_words": 80, "x": 1}}) == [
        "config clean.min_words 50 -> 80"]
    assert config_changes({"tasks": []}, {"tasks": ["a"]}) == ['config tasks [] -> ["a"]']


@pytest.mark.slow
def test_nothing_changed_reuses_every_asset(smoke_run):
    rows = status(smoke_run, smoke_ops())
    assert running(rows) == set()
    for name, r in rows.items():
        assert r.version and r.materialized_at and r.reasons[0].startswith("inputs, config and code unchanged"), name
    text = format_status(list(rows.values()))
    assert text.splitlines()[-1] == f"nothing to run: all {len(NAMES)} assets would be reused"
    assert '"action": "reuse"' in status_json(list(rows.values()))


@pytest.mark.slow
def test_an_eval_only_change_predicts_exactly_what_the_run_recomputes(smoke_run):
    ops = smoke_ops(eval_scores={"config": {"tasks": ["kiln_continuation", "kiln_heldout_ppl"]}})
    rows = status(smoke_run, ops)
    assert running(rows) == {"eval_scores", "release_bundle"}
    assert rows["eval_scores"].reasons == ['config tasks [] -> ["kiln_continuation", "kiln_heldout_ppl"]']
    assert rows["release_bundle"].reasons == [f"upstream eval_scores changes: {rows['eval_scores'].reasons[0]}"]
    assert rows["eval_scores"].estimate_s > 0 and rows["eval_scores"].estimate_from == "last run"
    result = rerun(smoke_run, NAMES, ops)
    assert result.success
    assert computed_assets(smoke_run, result.run_id) == running(rows)
    after = status(smoke_run, ops)  # that run is now the latest: the same preset again reuses everything
    assert running(after) == set()
    back = status(smoke_run, smoke_ops())  # the smoke preset again: its earlier outputs are reused, and said so
    assert running(back) == set()
    assert back["eval_scores"].reasons[0].startswith("inputs, config and code the same as an earlier run")


@pytest.mark.slow
def test_a_filter_change_recomputes_the_clean_corpus_and_everything_below_it(smoke_run):
    _, defs, _, _ = smoke_run
    rows = status(smoke_run, smoke_ops(clean_corpus={"config": {"clean": {"min_words": 80}}}))
    old = load_min_words()
    assert rows["clean_corpus"].reasons == [f"config clean.min_words {old} -> 80"]
    assert rows["raw_documents"].action == "reuse"
    assert running(rows) == downstream_of(defs, "clean_corpus")
    assert rows["base_model"].reasons == [f"upstream clean_corpus changes: config clean.min_words {old} -> 80"]
    assert rows["base_model"].estimate_s > 0
    text = format_status(list(rows.values()))
    assert f"    config clean.min_words {old} -> 80" in text.splitlines()
    assert text.splitlines()[-1].startswith(f"{len(running(rows))} of {len(NAMES)} assets would run, about ")


@pytest.mark.slow
def test_a_damaged_output_is_named_and_left_in_place(smoke_run):
    home, _, instance, _ = smoke_run
    from dagster import AssetKey

    ops = smoke_ops(eval_scores={"config": {"tasks": ["kiln_continuation", "kiln_heldout_ppl"]}})  # the latest run's
    version = instance.get_latest_materialization_event(AssetKey("eval_scores")).asset_materialization.tags[
        "dagster/data_version"]
    target = home / "storage" / "eval_scores" / version / "scores.json"
    original = target.read_bytes()
    try:
        target.write_bytes(original[:-1] + b" ")  # same size, other bytes: found by its checksum
        rows = status(smoke_run, ops)
        assert running(rows) == {"eval_scores", "release_bundle"}
        assert str(target) in rows["eval_scores"].reasons[0] and "checksum mismatch" in rows["eval_scores"].reasons[0]
        assert target.read_bytes() == original[:-1] + b" "  # looked at, not set aside
    finally:
        target.write_bytes(original)


def load_min_words() -> int:
    from kiln.clean.config import CleanSettings

    return CleanSettings().min_words


@pytest.mark.slow
def test_a_failed_training_attempt_resumes_from_its_verified_checkpoint(smoke_run, tmp_path, monkeypatch):
    """base_model with checkpoints every 5 steps fails at step 7 (tests/faults.py): the next run with those
    settings resumes from step 5; with other settings it trains in another run folder, so it recomputes."""
    from dagster import AssetKey
    from dagster._core.execution.retries import RetryMode
    from dagster._core.executor.in_process import InProcessExecutor

    from jobs.definitions import complete_resource_config
    from tests.faults import Faults

    _, defs, instance, _ = smoke_run
    ops = smoke_ops(base_model={"config": {"ckpt_interval": 5}})
    monkeypatch.setattr("resources.torchrun.WORKER_MODULE", "tests.faults")
    monkeypatch.setenv("KILN_FAULTS", str(Faults(fail_at_step=7).write(tmp_path / "faults.json")))
    init = InProcessExecutor.__init__  # no Dagster retry and no torchrun restart: the attempt stays failed
    monkeypatch.setattr(InProcessExecutor, "__init__", lambda self, retries, **kw: init(self, RetryMode.DISABLED, **kw))
    run_config = complete_resource_config({"ops": ops, "resources": {"torchrun": {"config": {"max_restarts": 0}}}},
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
    print(line)
