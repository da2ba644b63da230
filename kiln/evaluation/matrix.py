"""The checkpoint x benchmark matrix: each standard benchmark's score on each training checkpoint is one cell, kept in
its own folder, so that adding a benchmark scores only its column, a new checkpoint only its row, and a rerun
reuses every finished cell.

A cell lives at ``ROOT/<run>/step_<NNNNNNN>/<benchmark>/cell.json`` and records what it was scored from (its
``inputs``: the checkpoint's identity, the benchmark's lm-eval version, the data package, the sample's limit, seed and
hash, the contamination report): ``reusable(folder, inputs)`` returns it only when those are the same and the file is
whole (its own digest checks). ``series(root, run, benchmark)`` gives a run's scores by step for the plot of score
against training step (``plot_series``: the score, its 95% interval and chance).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.common.files import atomic_write_json, stable_hash

CELL_FILE = "cell.json"
CELL_VERSION = 1  # bump when what a cell holds, or how it is scored, changes: every cell is then rescored


def cell_folder(root: str | Path, run: str, step: int, benchmark: str) -> Path:
    return Path(root) / run / f"step_{step:07d}" / benchmark


def cell_inputs(checkpoint_id: str, benchmark: str, record: dict[str, Any], contamination: str | None) -> dict[str, Any]:
    """What a cell's score depends on: the checkpoint, the benchmark's definition and data, the sample, and the
    contamination report its clean score used (the batch size and device are left out: scores do not depend on
    them, tests/kiln/evaluation check it)."""
    bench = record["benchmarks"][benchmark]
    return {"cell_version": CELL_VERSION, "checkpoint": checkpoint_id, "benchmark": benchmark,
            "lm_eval": record["lm_eval"], "version": bench.get("version"), "package": record["package"]["sha256"],
            "limit": record["limit"], "seed": record["seed"], "sample_sha256": record["sample_sha256"],
            "contamination": contamination}


def read_cell(path: str | Path) -> dict[str, Any] | None:
    """The cell in the file at ``path`` when the file is whole (its digest checks); else None."""
    try:
        cell = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cell, dict) or cell.get("digest") != stable_hash({k: v for k, v in cell.items() if k != "digest"}):
        return None
    return cell


def reusable(folder: str | Path, inputs: dict[str, Any]) -> dict[str, Any] | None:
    """The finished cell in ``folder`` when it was scored from ``inputs`` and its file is whole; else None (a cell
    from other inputs, a damaged or half-written file: scored again)."""
    cell = read_cell(Path(folder) / CELL_FILE)
    return cell if cell is not None and cell.get("inputs") == inputs else None


def write_cell(folder: str | Path, inputs: dict[str, Any], full: dict[str, Any], clean: dict[str, Any] | None,
               primary: str, step: int, run: str, seconds: float) -> dict[str, Any]:
    """Write a scored cell atomically (with a digest of its contents, checked on reuse) and return it."""
    metric = primary.split(",", 1)[0]
    body = {"inputs": inputs, "run": run, "step": step, "benchmark": inputs["benchmark"], "primary": primary,
            "score": full.get(metric), "stderr": full.get(f"{metric}_stderr"), "items": full.get("items"),
            "chance": full.get("chance"), "full": full, "clean": clean, "seconds": round(seconds, 2)}
    cell = {**body, "digest": stable_hash(body)}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / CELL_FILE, cell)
    return cell


def cells(root: str | Path, run: str = "*", benchmark: str = "*") -> list[dict[str, Any]]:
    """Every whole cell under ``root`` (damaged files left out), of one run or benchmark when named, by run, step
    and benchmark."""
    found = (read_cell(p) for p in Path(root).glob(f"{run}/step_*/{benchmark}/{CELL_FILE}"))
    return sorted((c for c in found if c is not None), key=lambda c: (c["run"], c["step"], c["benchmark"]))


def series(root: str | Path, run: str, benchmark: str) -> list[tuple[int, float, float]]:
    """(step, score, standard error) of one run's cells of one benchmark, by step."""
    return [(c["step"], c["score"], c["stderr"] or 0.0) for c in cells(root, run, benchmark) if c["score"] is not None]


def plot_series(points: list[tuple[int, float, float]], chance: float | None) -> dict[str, Any]:
    """The plot's parts: the score by step, its 95% interval (score -/+ 1.96 standard errors) and chance."""
    return {"series": {"score": [(s, v) for s, v, _ in points]},
            "bands": {"95% interval": [(s, v - 1.96 * se, v + 1.96 * se) for s, v, se in points]},
            "hlines": {"chance": chance} if chance is not None else {}}
