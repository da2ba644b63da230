"""Evaluation automation: the per-checkpoint evaluation job, the sensor that evaluates new checkpoints, the nightly schedule.

Loaded by jobs/definitions.py; turn the sensor and schedule on in the Dagster UI (Automation) under ``make ui``.
"""

from __future__ import annotations

from dagster import (
    AssetKey,
    AssetSelection,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    MultiPartitionKey,
    RunRequest,
    ScheduleEvaluationContext,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    define_asset_job,
    schedule,
    sensor,
)

from assets._common import add_new_partitions
from assets.evals import (CHECKPOINTS, benchmark_matrix, benchmark_partitions, checkpoint_evals, checkpoint_partitions,
                          matrix_partitions)
from kiln.evaluation import checkpoints as kckpt
from resources.storage import KilnStorageResource

TRAINING_ASSET = "base_model"  # checkpoints are found under <storage root>/base_model/<run>/checkpoints/
NEEDS = ("eval_suite", "contamination_report")  # what every checkpoint evaluation reads
MAX_RUNS_PER_TICK = 8  # the sensor requests at most this many evaluations per tick, oldest checkpoints first
NIGHTLY_RUNS = 3  # the nightly schedule re-scores the newest checkpoint of this many most recently trained runs

checkpoint_eval_job = define_asset_job(
    "checkpoint_eval_job", selection=AssetSelection.assets(checkpoint_evals),  # partitioned like checkpoint_evals
    description="Evaluate one training checkpoint (a partition of checkpoint_evals) on every suite.",
)

benchmark_matrix_job = define_asset_job(
    "benchmark_matrix_job", selection=AssetSelection.assets(benchmark_matrix),  # checkpoint x benchmark partitions
    description="Score cells of the checkpoint x benchmark matrix (backfill a column, a row, or the missing cells).",
)


def matrix_columns(instance) -> list[str]:
    """The benchmarks of the matrix in use: those with at least one scored cell, in registry order."""
    done = instance.get_materialized_partitions(AssetKey("benchmark_matrix"))
    used = {matrix_partitions.get_partition_key_from_str(k).keys_by_dimension["benchmark"] for k in done}
    return [b for b in benchmark_partitions.get_partition_keys() if b in used]


def _missing_inputs(instance) -> list[str]:
    return [name for name in NEEDS if instance.get_latest_materialization_event(AssetKey(name)) is None]


@sensor(jobs=[checkpoint_eval_job, benchmark_matrix_job], minimum_interval_seconds=60,
        default_status=DefaultSensorStatus.STOPPED)
def new_checkpoint_sensor(context: SensorEvaluationContext, storage: KilnStorageResource):
    """Registers each new training checkpoint as a partition of checkpoint_evals (and a row of benchmark_matrix) and requests its evaluation: every suite, and its cell of each benchmark column already in use in the matrix."""
    refs = kckpt.discover(storage.path(TRAINING_ASSET))
    known = set(context.instance.get_dynamic_partitions(CHECKPOINTS))
    new = [r for r in refs if r.key not in known][:MAX_RUNS_PER_TICK]
    if not new:
        return SkipReason(f"no new checkpoints ({len(refs)} known under {storage.path(TRAINING_ASSET)})")
    missing = _missing_inputs(context.instance)
    if missing:
        return SkipReason(f"{len(new)} new checkpoint(s) wait for {', '.join(missing)}: materialize them first")
    keys = [r.key for r in new]
    columns = matrix_columns(context.instance)
    suites = [RunRequest(run_key=r.key, partition_key=r.key, job_name=checkpoint_eval_job.name,
                         tags={"kiln/trigger": "new_checkpoint"}) for r in new]
    cells = [RunRequest(run_key=f"matrix-{r.key}-{b}", job_name=benchmark_matrix_job.name,
                        partition_key=MultiPartitionKey({"benchmark": b, "checkpoint": r.key}),
                        tags={"kiln/trigger": "new_checkpoint"}) for r in new for b in columns]
    return SensorResult(run_requests=suites + cells,
                        dynamic_partitions_requests=[checkpoint_partitions.build_add_request(keys)])


@schedule(job=checkpoint_eval_job, cron_schedule="0 2 * * *", name="nightly_eval_schedule",
          default_status=DefaultScheduleStatus.STOPPED)
def nightly_eval_schedule(context: ScheduleEvaluationContext, storage: KilnStorageResource):
    """Every night at 02:00, re-scores the newest checkpoint of each of the most recently trained runs."""
    refs = kckpt.latest_per_run(kckpt.discover(storage.path(TRAINING_ASSET)), NIGHTLY_RUNS)
    if not refs:
        return SkipReason(f"no training checkpoints under {storage.path(TRAINING_ASSET)}")
    missing = _missing_inputs(context.instance)
    if missing:
        return SkipReason(f"checkpoint evaluation needs {', '.join(missing)}: materialize them first")
    add_new_partitions(context.instance, CHECKPOINTS, [r.key for r in refs])  # schedules cannot request partitions
    night = context.scheduled_execution_time.strftime("%Y-%m-%d")
    return [RunRequest(run_key=f"nightly-{night}-{r.key}", partition_key=r.key, tags={"kiln/trigger": "nightly"})
            for r in refs]
