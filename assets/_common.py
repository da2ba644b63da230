"""Helpers shared by the asset modules: content-addressed outputs, metadata formatting, plots."""


import base64
import io
from pathlib import Path
from typing import Any, Iterable

from dagster import DataVersion, MetadataValue

from kiln.common.files import commit_dir, manifest_of_dir, stable_hash


def commit_output(staged: Path, parent: Path, volatile: tuple[str, ...] = ()) -> tuple[Path, str]:
    """Move a staged folder to ``parent/<content hash>`` and return (folder, data version).

    Files named in ``volatile`` (reports holding timings) are kept but left out of the hash, so the same data
    gets the same version however long it took; when that folder exists already, it is kept as it is."""
    manifest = {k: v for k, v in manifest_of_dir(staged).items() if k not in volatile}
    version = stable_hash(manifest)[:16]
    return commit_dir(staged, parent / version), version


def data_version(version: str) -> DataVersion:
    return DataVersion(version)


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
              save_to: Path | None = None) -> MetadataValue:
    """A small PNG line plot embedded as markdown (and saved to ``save_to`` for MLflow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=90)
    for name, pts in series.items():
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="." if len(pts) < 30 else None, label=name)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    if save_to is not None:
        save_to.write_bytes(buf.getvalue())
    return MetadataValue.md(f"![{title}](data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()})")


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
