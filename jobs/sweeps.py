"""``kiln sweep`` and ``kiln ablate``: a sweep from start to end, as the UI would run it by hand: the data assets,
the grid asset (which registers one partition of the point asset per point), every partition of the point asset
(each a short training run, or a data point's proxies, reused when it already ran), then the results asset.

``run_sweep(defs, instance, ops, say)`` is the whole of it (``kind=ABLATION`` for an ablation); the CLI passes the
preset's op settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from dagster import AssetKey

DATA_ASSETS = ["pretrained_model", "raw_documents", "clean_corpus", "tokenizer", "token_shards"]


@dataclass(frozen=True)
class SweepKind:
    """The assets and jobs of one kind of sweep."""

    data: tuple[str, ...]  # the pipeline's assets it reads, materialized (or reused) first
    grid: str  # asset that registers the partitions; its job is <grid>_job
    point: str  # the partitioned asset; its job is <point>_job
    results: str  # asset that reads every point; its job is <results>_job
    show: Callable[[dict[str, Any]], str]  # a point's output as a few words for the progress line
    verb: str  # the kiln command that runs it
    example: str  # the preset that shows its grid block


SWEEP = SweepKind(tuple(DATA_ASSETS), "sweep_grid", "sweep", "sweep_results",
                  lambda v: f"final val loss {v['final_val_loss']:.4f}", "sweep", "sweep-demo")
ABLATION = SweepKind(("pretrained_model", "raw_documents", "clean_corpus", "tokenizer"), "ablation_grid", "ablation",
                     "ablation_report", lambda v: "done", "ablate", "ablation-demo")


class SweepFailed(RuntimeError):
    """A step of the sweep failed; the message names the step (and the point) and the error, in one line."""

    def __init__(self, message: str, result=None):
        super().__init__(message)
        self.result = result  # the failed run (its events hold the full traces), None for a refused config


def _check(result, what: str) -> None:
    if result.success:
        return
    from jobs.errors import innermost_error

    failed = [e for e in result.all_events if e.is_step_failure]
    kind, message = innermost_error(failed[0].step_failure_data.error) if failed else ("", "the run failed")
    raise SweepFailed(f"{what} failed: {kind + ': ' if kind else ''}{message}", result)


def run_sweep(defs, instance, ops: dict[str, Any], say: Callable[[str], None] = print,
              tags: dict[str, str] | None = None, console=None, kind: SweepKind = SWEEP) -> dict[str, Any]:
    """Materialize the data, the grid, every point and the results; return the results asset's value. ``ops`` is
    a preset's op settings (those of the data assets, the grid and the results are used). ``console``: a
    jobs.console.RunConsole that every run logs to (kiln sweep's), as kiln run's does; None: Dagster's default."""
    from dagster import DagsterInvalidConfigError, validate_run_config

    from jobs.errors import config_error_line

    tags = tags or {}
    pick = lambda names: {k: v for k, v in ops.items() if k in names}  # noqa: E731

    def one_line(job, what: str, call: Callable[[], Any]) -> Any:
        """``call()``, a config Dagster refuses (a typo or a wrong type in the preset) as one SweepFailed line."""
        try:
            return call()
        except DagsterInvalidConfigError as e:
            raise SweepFailed(f"{what}: {config_error_line(e, job)}") from None

    def execute(name: str, what: str, run_config: dict[str, Any] | None = None, **kwargs):
        job = defs.resolve_job_def(name)
        run_config = dict(run_config or {})
        if console is not None:
            job = job.with_logger_defs(console.logger_defs())
            run_config["loggers"] = console.loggers_config()
        result = one_line(job, what, lambda: job.execute_in_process(run_config=run_config, instance=instance,
                                                                    raise_on_error=False, tags=tags, **kwargs))
        _check(result, what)
        return result

    # (job, what a failure names, its run config): every setting checked before anything runs
    verb = f"kiln {kind.verb}"
    data, grid, results = [(name, what, {"ops": pick(names)}) for name, what, names in (
        ("kiln_pipeline_job", f"the data assets ({kind.data[1]} .. {kind.data[-1]})", kind.data),
        (f"{kind.grid}_job", kind.grid, [kind.grid]), (f"{kind.results}_job", kind.results, [kind.results]))]
    for name, what, run_config in (data, grid, results):
        job = defs.resolve_job_def(name)
        one_line(job, what, lambda: validate_run_config(job, run_config))
    execute(*data, asset_selection=[AssetKey(k) for k in kind.data])
    points = execute(*grid).output_for_node(kind.grid)["points"]
    keys = [p["key"] for p in points]
    say(f"{verb}: {len(keys)} points: {', '.join(keys)}")
    for i, key in enumerate(keys):
        value = execute(f"{kind.point}_job", f"point {i + 1}/{len(keys)} ({key})",
                        partition_key=key).output_for_node(kind.point)
        say(f"{verb}: point {i + 1}/{len(keys)} {key}: {kind.show(value)}")
    result = execute(*results)
    return result.output_for_node(kind.results)
