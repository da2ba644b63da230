"""``kiln sweep``: a hyper-parameter sweep from start to end, as the UI would run it by hand: the data assets,
``sweep_grid`` (which registers one partition of ``sweep`` per point), every partition of ``sweep`` (each a short
training run, reused when it already ran), then ``sweep_results``.

``run_sweep(defs, instance, ops, say)`` is the whole of it; the CLI passes the preset's op settings.
"""

from __future__ import annotations

from typing import Any, Callable

from dagster import AssetKey

DATA_ASSETS = ["pretrained_model", "raw_documents", "clean_corpus", "tokenizer", "token_shards"]


class SweepFailed(RuntimeError):
    """A step of the sweep failed; the message names the step (and the point) and the error."""


def _check(result, what: str) -> None:
    if result.success:
        return
    from jobs.cli import innermost_error

    failed = [e for e in result.all_events if e.is_step_failure]
    kind, message = innermost_error(failed[0].step_failure_data.error) if failed else ("", "the run failed")
    raise SweepFailed(f"{what} failed: {kind + ': ' if kind else ''}{message}")


def run_sweep(defs, instance, ops: dict[str, Any], say: Callable[[str], None] = print,
              tags: dict[str, str] | None = None) -> dict[str, Any]:
    """Materialize the data, the grid, every point and the results; return sweep_results' value. ``ops`` is a
    preset's op settings (those of the data assets, sweep_grid and sweep_results are used)."""
    tags = tags or {}
    data = defs.resolve_job_def("kiln_pipeline_job")
    pick = lambda names: {k: v for k, v in ops.items() if k in names}  # noqa: E731
    result = data.execute_in_process(run_config={"ops": pick(DATA_ASSETS)}, instance=instance, raise_on_error=False,
                                     asset_selection=[AssetKey(k) for k in DATA_ASSETS], tags=tags)
    _check(result, "the data assets (raw_documents .. token_shards)")
    result = defs.resolve_job_def("sweep_grid_job").execute_in_process(
        run_config={"ops": pick(["sweep_grid"])}, instance=instance, raise_on_error=False, tags=tags)
    _check(result, "sweep_grid")
    grid = result.output_for_node("sweep_grid")
    keys = [p["key"] for p in grid["points"]]
    say(f"kiln sweep: {len(keys)} points: {', '.join(keys)}")
    job = defs.resolve_job_def("sweep_job")
    for i, key in enumerate(keys):
        result = job.execute_in_process(partition_key=key, instance=instance, raise_on_error=False, tags=tags)
        _check(result, f"point {i + 1}/{len(keys)} ({key})")
        value = result.output_for_node("sweep")
        say(f"kiln sweep: point {i + 1}/{len(keys)} {key}: final val loss {value['final_val_loss']:.4f}")
    result = defs.resolve_job_def("sweep_results_job").execute_in_process(
        run_config={"ops": pick(["sweep_results"])}, instance=instance, raise_on_error=False, tags=tags)
    _check(result, "sweep_results")
    return result.output_for_node("sweep_results")
