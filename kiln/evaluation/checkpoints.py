"""Training checkpoints as evaluation partitions: find them under a training folder, key them, collect scores by step.

Run: ``python -m kiln.evaluation.checkpoints .kiln/storage/base_model`` lists every checkpoint's partition key.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.train.checkpoint import CheckpointError, list_checkpoints

_KEY = re.compile(r"^(?P<run>[A-Za-z0-9_.-]+?)-step(?P<step>\d{7,})$")
SCORES_FILE = "scores.json"
# The number each task is judged by: length-normalised accuracy for endings (as HellaSwag), accuracy for MMLU and
# last words, bits per byte for perplexity; other tasks use acc_norm, else acc.
PRIMARY = {"kiln_continuation": "acc_norm", "kiln_lastword": "acc", "kiln_mmlu": "acc", "kiln_heldout_ppl": "bits_per_byte"}


@dataclass(frozen=True)
class CheckpointRef:
    """One checkpoint of one training run, as the per-checkpoint evaluation sees it."""

    key: str  # partition key: "<run folder>-step<NNNNNNN>"
    run: str  # training run folder name under the training root (a hash of the run's inputs)
    step: int  # optimizer step the checkpoint was saved at
    path: Path  # the step_NNNNNNN folder
    mtime: float  # when its meta.json was written (seconds since the epoch)


def checkpoint_key(run: str, step: int) -> str:
    return f"{run}-step{step:07d}"


def parse_key(key: str) -> tuple[str, int]:
    """(run folder, step) of a partition key; a malformed key raises ValueError naming it."""
    m = _KEY.match(key)
    if m is None:
        raise ValueError(f"checkpoint partition key {key!r} is not '<run folder>-step<7+ digits>', e.g. 'a1b2c3-step0000200'")
    return m["run"], int(m["step"])


def discover(train_root: str | Path) -> list[CheckpointRef]:
    """Every complete checkpoint under ``train_root/<run>/checkpoints/``, oldest first."""
    root = Path(train_root)
    refs = []
    for run_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.is_dir() else []:
        for ckpt in list_checkpoints(run_dir / "checkpoints"):
            step = int(ckpt.name.removeprefix("step_"))
            refs.append(CheckpointRef(checkpoint_key(run_dir.name, step), run_dir.name, step, ckpt,
                                      (ckpt / "meta.json").stat().st_mtime))
    return sorted(refs, key=lambda r: (r.mtime, r.run, r.step))


def resolve(train_root: str | Path, key: str) -> CheckpointRef:
    """The checkpoint a partition key names; raises CheckpointError when it is gone (pruned or deleted)."""
    run, step = parse_key(key)
    path = Path(train_root) / run / "checkpoints" / f"step_{step:07d}"
    if not (path / "meta.json").is_file():
        raise CheckpointError(
            f"checkpoint {key}: {path} does not exist (any more). Training keeps only its newest checkpoints "
            "(base_model.keep_last): evaluate checkpoints as they appear (turn on new_checkpoint_sensor) or keep more"
        )
    return CheckpointRef(key, run, step, path, (path / "meta.json").stat().st_mtime)


def latest_per_run(refs: list[CheckpointRef], max_runs: int) -> list[CheckpointRef]:
    """The newest checkpoint of each of the ``max_runs`` most recently updated training runs, newest first."""
    newest: dict[str, CheckpointRef] = {}
    for r in refs:
        if r.run not in newest or r.step > newest[r.run].step:
            newest[r.run] = r
    return sorted(newest.values(), key=lambda r: -r.mtime)[:max_runs]


def training_run_id(train_root: str | Path, run: str) -> str | None:
    """The MLflow run id the training job of ``run`` logged to (from its job.json), if recorded."""
    job = Path(train_root) / run / "job.json"
    try:
        return json.loads(job.read_text()).get("mlflow_run_id") or None
    except (OSError, json.JSONDecodeError):
        return None


def primary_metric(task: str, row: dict[str, Any]) -> str | None:
    name = PRIMARY.get(task.removesuffix("_clean"))
    if name is None:
        name = "acc_norm" if "acc_norm" in row else "acc"
    return name if isinstance(row.get(name), (int, float)) else None


def score_history(results_root: str | Path) -> list[dict[str, Any]]:
    """Every evaluated step of one training run, by step: the newest ``scores.json`` under ``step_NNNNNNN/<version>/``."""
    out = []
    for step_dir in sorted(Path(results_root).glob("step_*")):
        files = sorted(step_dir.glob(f"*/{SCORES_FILE}"), key=lambda p: p.stat().st_mtime)
        if files:
            out.append(json.loads(files[-1].read_text()))
    return sorted(out, key=lambda s: s["step"])


def curves(history: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Points for score-against-step plots: {"accuracy": {series: [(step, value)]}, "bits_per_byte": {...}}.

    Accuracy series: each task's primary metric, on its clean items too where any were contaminated, and one line
    per distinct non-zero chance level; the bits-per-byte series: held-out perplexity tasks.
    """
    acc: dict[str, list[tuple[float, float]]] = {}
    bpb: dict[str, list[tuple[float, float]]] = {}
    for h in history:
        full, clean = h.get("tasks", {}), h.get("tasks_clean", {})
        for task, row in full.items():
            metric = primary_metric(task, row)
            if metric is None:
                continue
            target = bpb if metric == "bits_per_byte" else acc
            target.setdefault(f"{task} {metric}", []).append((h["step"], row[metric]))
            if row.get("contaminated") and isinstance(clean.get(task, {}).get(metric), (int, float)):
                target.setdefault(f"{task} {metric} (clean)", []).append((h["step"], clean[task][metric]))
            chance = row.get("chance")
            if target is acc and isinstance(chance, (int, float)) and chance > 0:
                line = acc.setdefault(f"chance {chance:g}", [])
                if not line or line[-1][0] != h["step"]:
                    line.append((h["step"], chance))
    return {"accuracy": acc, "bits_per_byte": bpb}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("train_root", help="the training asset's folder, e.g. .kiln/storage/base_model")
    args = p.parse_args(argv)
    for r in discover(args.train_root):
        print(f"{r.key}\t{r.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
