"""Helpers shared by the asset modules: the output pattern (MLflow run, reuse, staging, commit, Output), metadata, plots.

An asset body: ``with asset_output(context, mlflow, parent=storage.path("x"), config=config) as out:`` (see asset_output).
"""

import base64
import contextlib
import math
from pathlib import Path
from typing import Any, Iterable, Iterator

from dagster import DataVersion, MetadataValue, Output

from kiln.common.files import commit_dir, manifest_of_dir, stable_hash, staging_dir
from kiln.common.plots import line_plot_png
from resources.base import failing_on_config_errors, failing_on_damage

def content_version(staged: Path, volatile: tuple[str, ...] = ()) -> str:
    """The data version of a folder: a hash of its files' sizes and sha256s, those named in ``volatile`` left out."""
    return stable_hash({k: v for k, v in manifest_of_dir(staged).items() if k not in volatile})[:16]


def commit_output(staged: Path, parent: Path, volatile: tuple[str, ...] = ()) -> tuple[Path, str]:
    """Move a staged folder to ``parent/<content hash>`` and return (folder, data version).

    Files named in ``volatile`` (reports holding timings) are kept but left out of the hash, so the same data
    gets the same version however long it took; when that folder exists already, it is kept as it is."""
    version = content_version(staged, volatile)
    return commit_dir(staged, parent / version), version


class AssetOutput:
    """What an asset body writes its output through (made by asset_output): ``reused``, ``stage``, ``commit``,
    ``result``, and the MLflow child run's ``log_metrics``, ``log_artifact``, ``set_tags``, ``run_id``."""

    def __init__(self, run, parent: Path | None, stage: Path | None):
        self.run = run  # resources.tracking.AssetRun, or None without MLflow
        self.reused: Output | None = run.reused if run is not None else None  # return it when set
        self.parent = parent
        self._stage = stage
        self.final: Path | None = None  # the committed folder
        self.version: str | None = None  # its data version

    @property
    def stage(self) -> Path:
        """The staging folder (deleted at the end unless committed)."""
        if self._stage is None:
            raise RuntimeError("no staging folder: return out.reused first when it is set, and give asset_output "
                               "parent= for an asset that writes a folder")
        return self._stage

    def commit(self, volatile: tuple[str, ...] = (), folder: Path | None = None, into: Path | None = None) -> Path:
        """Move the staged folder to ``<into or parent>/<content hash>``, or to ``folder`` when the caller keys it
        (e.g. by its inputs); the content hash, without the ``volatile`` files (timings), is the data version."""
        self.version = content_version(self.stage, volatile)
        self.final = commit_dir(self.stage, folder if folder is not None else (into or self.parent) / self.version)
        return self.final

    def result(self, value: Any, metadata: dict[str, Any] | None = None, version: str | None = None) -> Output:
        """The Output: ``value``, the data version (the commit's, or ``version`` for an asset without a folder),
        ``metadata`` plus the MLflow run's link; recorded in MLflow so an identical later run reuses it."""
        version = version or self.version
        if version is None:
            raise ValueError("AssetOutput.result: no data version; commit() the staged folder or pass version=")
        if self.run is None:
            return Output(value, data_version=DataVersion(version), metadata=dict(metadata or {}))
        return self.run.output(value, version, {**(metadata or {}), **mlflow_meta(self.run)})

    @property
    def run_id(self) -> str:
        return self.run.run_id

    @property
    def tracking_uri(self) -> str:
        return self.run.tracking_uri

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        self.run.log_metrics(metrics, step)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self.run.log_artifact(path, artifact_path)

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.run.set_tags(tags)


def _version_of(v: Any) -> Any:
    return v["version"] if isinstance(v, dict) else v


@contextlib.contextmanager
def asset_output(context, mlflow, *, parent: Path | None = None, config=None, inputs: dict[str, Any] | None = None,
                 params: dict[str, Any] | None = None, tags: dict[str, Any] | None = None,
                 reuse: dict[str, Any] | None = None) -> Iterator[AssetOutput]:
    """The MLflow child run of the asset being materialized, with reuse, and a staging folder under ``parent``::

        with asset_output(context, mlflow, parent=storage.path("tokenizer"), config=config,
                          inputs={"clean_corpus": clean_corpus}) as out:
            if out.reused:
                return out.reused
            write(out.stage / "tokenizer.json")
            final = out.commit()
            return out.result({"path": str(final / "tokenizer.json"), "version": out.version}, {"n_vocab": n})

    config: the asset's Config; logged as params and part of the reuse key (as ``config``).
    inputs: {name: upstream output or its data version}; tagged ``input.<name>`` and part of the reuse key.
    params, tags, reuse: logged params (default: the config), more tags, more reuse-key entries. With none of
    config, inputs, reuse the output is never reused. ``mlflow`` None: no MLflow run, no reuse.
    No staging folder is made when ``parent`` is None or an earlier run is reused. A config error raised in the
    body fails the asset at once, without retries (failing_on_config_errors); so does a damaged upstream file, which is
    set aside so that the next run recomputes it (failing_on_damage)."""
    with failing_on_config_errors(), failing_on_damage():
        yield from _asset_output(context, mlflow, parent, config, inputs, params, tags, reuse)


def _asset_output(context, mlflow, parent, config, inputs, params, tags, reuse) -> Iterator[AssetOutput]:
    given = {k: _version_of(v) for k, v in (inputs or {}).items() if v is not None}
    if mlflow is None:
        runs = contextlib.nullcontext(None)
    else:
        dump = config.model_dump() if config is not None else None
        key = {**({"config": dump} if config is not None else {}), **given, **(reuse or {})}
        runs = mlflow.asset_run(context, params=params if params is not None else dump,
                                tags={**{f"input.{k}": v for k, v in given.items()}, **(tags or {})},
                                reuse=key if (config is not None or inputs or reuse is not None) else None)
    with runs as run:
        if run is not None and run.reused is not None:
            yield AssetOutput(run, parent, None)
            return
        with staging_dir(parent) if parent is not None else contextlib.nullcontext(None) as stage:
            yield AssetOutput(run, parent, stage)


def data_version(version: str) -> DataVersion:
    return DataVersion(version)


def add_new_partitions(instance, partitions: str, keys: Iterable[str]) -> list[str]:
    """Register the ``keys`` not yet partitions of the dynamic partitions ``partitions``; the keys added, in order."""
    known = set(instance.get_dynamic_partitions(partitions))
    new = [k for k in keys if k not in known]
    if new:
        instance.add_dynamic_partitions(partitions, new)
    return new


def md_table(rows: Iterable[dict[str, Any]], columns: list[str] | None = None) -> MetadataValue:
    rows = list(rows)
    if not rows:
        return MetadataValue.md("_none_")
    columns = columns or list(rows[0])
    fmt = lambda v: f"{v:,.4g}" if isinstance(v, float) else (f"{v:,}" if isinstance(v, int) else str(v).replace("|", "\\|").replace("\n", " "))  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return MetadataValue.md("\n".join(lines))


def line_plot(series: dict[str, list[tuple[float, float]]], title: str, xlabel: str, ylabel: str,
              save_to: Path | None = None, bands: dict | None = None, hlines: dict | None = None) -> MetadataValue:
    """A small PNG line plot embedded as markdown (and saved to ``save_to`` for MLflow); bands and hlines as
    kiln.common.plots.line_plot_png draws them."""
    png = line_plot_png(series, title, xlabel, ylabel, bands=bands, hlines=hlines)
    if save_to is not None:
        save_to.write_bytes(png)
    return MetadataValue.md(f"![{title}](data:image/png;base64,{base64.b64encode(png).decode()})")


def mlflow_meta(run) -> dict[str, Any]:
    return {"mlflow_run": MetadataValue.url(run.url), "mlflow_run_id": run.run_id}


def report_metadata(report: dict[str, Any], run) -> dict[str, Any]:
    """Dagster metadata from a kiln report (kiln.train.launch: Table, Plot, FilePath, plain values): tables as
    markdown, plots as PNGs (saved and logged to the MLflow ``run``), paths as paths, None left out; then the run's link."""
    from kiln.train.launch import FilePath, Plot, Table

    meta: dict[str, Any] = {}
    for key, v in report.items():
        if isinstance(v, Table):
            meta[key] = md_table(v.rows, v.columns)
        elif isinstance(v, Plot):
            meta[key] = line_plot(v.series, v.title, v.xlabel, v.ylabel, save_to=v.file)
            run.log_artifact(v.file)
        elif isinstance(v, FilePath):
            meta[key] = MetadataValue.path(v.path)
        elif v is not None:
            meta[key] = v
    return {**meta, **mlflow_meta(run)}


def point_records(files: dict[str, Path], results: str, point_asset: str, command: str) -> list[dict[str, Any]]:
    """The records a sweep's partitions wrote ({point key: its file}), in order, for the results asset ``results``;
    a point not run yet or an unreadable file fails it in one line naming the partitions of ``point_asset`` to
    materialize (``command`` runs them all)."""
    import json

    from dagster import Failure

    records, missing = [], []
    for key, f in files.items():
        if not f.is_file():
            missing.append(key)
            continue
        try:
            records.append(json.loads(f.read_text()))
        except ValueError as e:
            raise Failure(f"{results}: {f} is not readable ({e}); rematerialize partition {key!r} of {point_asset}")
    if missing:
        raise Failure(f"{results}: {len(missing)} of {len(files)} points have not run: {', '.join(missing)}. "
                      f"Materialize those partitions of {point_asset} ({command} runs them)")
    return records


def log_child_run(out: AssetOutput, name: str, kind: str, params: dict[str, Any], metrics: dict[str, float],
                  curve: list[tuple[int, float]] = (), tags: dict[str, str] | None = None) -> None:
    """One finished MLflow child run under the asset's run ``out`` (a sweep's point, an ablation's point and seed):
    its params (names MLflow refuses, a glob's * or ?, written with _), finite metrics, and a val_loss curve."""
    import re

    client = out.run.client
    child = client.create_run(out.run.experiment_id, tags={"mlflow.parentRunId": out.run_id, "mlflow.runName": name,
                                                           "kiln.kind": kind, **(tags or {})})
    for k, v in params.items():
        client.log_param(child.info.run_id, re.sub(r"[^\w\-. :/]", "_", k), v)
    for k, v in metrics.items():
        if v is not None and math.isfinite(v):
            client.log_metric(child.info.run_id, k, v)
    for step, loss in curve:
        client.log_metric(child.info.run_id, "val_loss", loss, step=int(step))
    client.set_terminated(child.info.run_id, "FINISHED")
