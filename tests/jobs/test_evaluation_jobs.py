"""Evaluation automation: the new-checkpoint sensor, the nightly schedule's run requests, and how they are wired.

Run: python -m pytest tests/jobs/test_evaluation_jobs.py -q   (no models are run; a few seconds)
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

from dagster import (
    AssetKey,
    AssetMaterialization,
    DagsterInstance,
    MultiPartitionKey,
    SensorResult,
    SkipReason,
    build_schedule_context,
    build_sensor_context,
    instance_for_test,
)

from assets.evals import CHECKPOINTS
from jobs.definitions import defs
from jobs.nightly import benchmark_matrix_job, checkpoint_eval_job, new_checkpoint_sensor, nightly_eval_schedule
from resources.storage import KilnStorageResource


def fake_checkpoint(root: Path, run: str, step: int, mtime: float) -> Path:
    """A checkpoint folder as discovery sees it (meta.json present); its age set by mtime."""
    folder = root / "base_model" / run / "checkpoints" / f"step_{step:07d}"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"step": step}))
    os.utime(folder / "meta.json", (mtime, mtime))
    return folder


def materialized(instance: DagsterInstance, *names: str) -> None:
    for name in names:
        instance.report_runless_asset_event(AssetMaterialization(name))


def test_sensor_registers_and_requests_each_new_checkpoint_once(tmp_path):
    storage = KilnStorageResource(root=str(tmp_path))
    fake_checkpoint(tmp_path, "runA", 200, 1000)
    fake_checkpoint(tmp_path, "runA", 100, 900)
    instance = DagsterInstance.ephemeral()

    def tick():
        with build_sensor_context(instance=instance, resources={"storage": storage}) as ctx:
            return new_checkpoint_sensor(ctx)

    waiting = tick()
    assert isinstance(waiting, SkipReason) and "eval_suite, contamination_report" in waiting.skip_message
    materialized(instance, "eval_suite", "contamination_report")

    first = tick()
    assert isinstance(first, SensorResult)
    assert [r.partition_key for r in first.run_requests] == ["runA-step0000100", "runA-step0000200"]  # oldest first
    assert [r.run_key for r in first.run_requests] == ["runA-step0000100", "runA-step0000200"]
    (add,) = first.dynamic_partitions_requests
    assert add.partitions_def_name == CHECKPOINTS and list(add.partition_keys) == ["runA-step0000100", "runA-step0000200"]

    instance.add_dynamic_partitions(CHECKPOINTS, list(add.partition_keys))  # what the daemon does with the request
    assert isinstance(tick(), SkipReason)
    fake_checkpoint(tmp_path, "runB", 50, 1100)
    (again,) = tick().run_requests  # no matrix column in use yet: the suites alone
    assert again.partition_key == "runB-step0000050" and again.tags["kiln/trigger"] == "new_checkpoint"
    assert again.job_name == checkpoint_eval_job.name

    # once a benchmark column of the matrix has a scored cell, a new checkpoint's row gets that column's cell too
    instance.report_runless_asset_event(AssetMaterialization(
        "benchmark_matrix", partition=MultiPartitionKey({"benchmark": "piqa", "checkpoint": "runA-step0000100"})))
    suites, cell = tick().run_requests
    assert suites.job_name == checkpoint_eval_job.name and cell.job_name == benchmark_matrix_job.name
    assert cell.partition_key == MultiPartitionKey({"benchmark": "piqa", "checkpoint": "runB-step0000050"})
    assert cell.run_key == "matrix-runB-step0000050-piqa"


def test_nightly_schedule_requests_the_latest_checkpoint_of_each_recent_run(tmp_path):
    storage = KilnStorageResource(root=str(tmp_path))
    with instance_for_test() as instance:  # schedules re-open their instance by reference: it must be persistent
        check_nightly(tmp_path, storage, instance)


def check_nightly(tmp_path: Path, storage: KilnStorageResource, instance: DagsterInstance) -> None:
    night = dt.datetime(2026, 11, 30, 2, 0, tzinfo=dt.timezone.utc)

    def tick():
        with build_schedule_context(instance=instance, scheduled_execution_time=night, resources={"storage": storage},
                                    repository_def=defs.get_repository_def()) as ctx:
            return nightly_eval_schedule.evaluate_tick(ctx)

    assert "no training checkpoints" in tick().skip_message
    for run, step, mtime in [("old", 400, 10), ("runA", 100, 900), ("runA", 200, 1000), ("runB", 50, 1100),
                             ("runC", 30, 950)]:
        fake_checkpoint(tmp_path, run, step, mtime)
    assert "materialize them first" in tick().skip_message
    materialized(instance, "eval_suite", "contamination_report")

    data = tick()
    keys = [r.partition_key for r in data.run_requests]
    assert keys == ["runB-step0000050", "runA-step0000200", "runC-step0000030"]  # newest run first; 3 runs at most
    assert [r.run_key for r in data.run_requests][0] == "nightly-2026-11-30-runB-step0000050"
    assert all(r.tags["kiln/trigger"] == "nightly" for r in data.run_requests)
    assert set(keys) <= set(instance.get_dynamic_partitions(CHECKPOINTS))  # registered, so the runs can launch
    assert nightly_eval_schedule.cron_schedule == "0 2 * * *"


def test_wiring():
    pipeline = defs.resolve_job_def("kiln_pipeline_job")
    keys = {k.to_user_string() for k in pipeline.asset_layer.executable_asset_keys}
    assert {"eval_suite", "contamination_report", "eval_scores"} <= keys and "checkpoint_evals" not in keys
    assert {c.name for c in pipeline.asset_layer.asset_graph.asset_check_keys} == {"contamination_below_threshold", "release_no_regression",
                                                                                     "release_red_team"}
    per_ckpt = defs.resolve_job_def("checkpoint_eval_job")
    assert per_ckpt.partitions_def.name == CHECKPOINTS
    assert {k.to_user_string() for k in per_ckpt.asset_layer.executable_asset_keys} == {"checkpoint_evals"}
    assert {j.name for j in defs.resolve_sensor_def("new_checkpoint_sensor").jobs} == {checkpoint_eval_job.name,
                                                                                       benchmark_matrix_job.name}
    matrix = defs.resolve_job_def("benchmark_matrix_job")
    assert set(matrix.partitions_def.partition_dimension_names) == {"benchmark", "checkpoint"}
    assert {k.to_user_string() for k in matrix.asset_layer.executable_asset_keys} == {"benchmark_matrix"}
    assert {p.to_user_string() for p in defs.resolve_asset_graph().get(AssetKey("benchmark_matrix")).parent_keys} == {
        "base_model", "eval_suite", "contamination_report"}
    assert defs.resolve_schedule_def("nightly_eval_schedule").job_name == checkpoint_eval_job.name
    graph = defs.resolve_asset_graph()
    parents = {p.to_user_string() for p in graph.get(AssetKey("checkpoint_evals")).parent_keys}
    assert parents == {"base_model", "eval_suite", "contamination_report"}
    release_up = {p.to_user_string() for p in graph.get(AssetKey("eval_scores")).parent_keys}
    assert "contamination_report" in release_up  # so the blocking check stands between it and release_bundle
