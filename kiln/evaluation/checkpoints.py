"""Training checkpoints as evaluation partitions: find and key them, score their suites into MLflow runs, collect by step.

Run: ``python -m kiln.evaluation.checkpoints .kiln/storage/base_model`` lists every checkpoint's partition key.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from kiln.common.metrics import MetricLogger
from kiln.evaluation.registry import REGISTRY
from kiln.evaluation.scores import flat_metrics, primary_metric
from kiln.evaluation.spec import LOCAL_PREFIX
from kiln.evaluation.suite import score_full_and_clean
from kiln.train.checkpoint import CheckpointError, list_checkpoints

_KEY = re.compile(r"^(?P<run>[A-Za-z0-9_.-]+?)-step(?P<step>\d{7,})$")
SCORES_FILE = "scores.json"


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


# ---- scoring one checkpoint into MLflow -------------------------------------------------------------------


def present_run(client, run_id: str | None, log) -> str | None:
    """``run_id`` if that run exists in this tracking store (else None: the eval runs are left unnested)."""
    if not run_id:
        return None
    try:
        client.get_run(run_id)
        return run_id
    except Exception:  # MlflowException: recorded by another tracking store
        log.warning(f"training MLflow run {run_id} is not in this tracking store; eval runs will not be nested under it")
        return None


def runnable_suites(suites: Mapping[str, list[str]], built: Mapping[str, Any], log) -> dict[str, list[str]]:
    """{suite: its tasks that can run}: local tasks must be in ``built`` (the eval suite); suites left empty are
    skipped with a warning. A kiln_* task that is not registered is an error naming the suite."""
    REGISTRY.check_suites(suites)
    out = {}
    for suite, wanted in suites.items():
        tasks = [t for t in wanted if t in built or not t.startswith(LOCAL_PREFIX)]
        if tasks:
            out[suite] = tasks
        else:
            log.warning(f"suite {suite}: none of {wanted} is in eval_suite; skipped")
    return out


@dataclass
class CheckpointRuns:
    """The MLflow runs of one checkpoint's evaluation: one per suite, nested under the training run when it is here."""

    client: Any  # mlflow.tracking.MlflowClient of the tracking store
    uri: str  # its tracking URI
    experiment_id: str  # where the runs are created
    ref: CheckpointRef  # the checkpoint evaluated
    train_run: str | None  # the training run's id, or None when it is not in this store
    tags: dict[str, str]  # added to every suite run (orchestrator run, partition, input versions)
    runs: dict[str, str] = field(default_factory=dict)  # suite -> run id, in creation order

    @contextlib.contextmanager
    def suite(self, name: str, params: dict[str, Any]) -> Iterator[MetricLogger]:
        """A run for one suite, FINISHED when the block completes and FAILED when it raises."""
        ref = self.ref
        tags = {"kiln.kind": "checkpoint_eval", "kiln.suite": name, "kiln.train.checkpoint": str(ref.path),
                "kiln.step": str(ref.step), "kiln.training_run": self.train_run or "",
                "mlflow.runName": f"eval {name} @ step {ref.step}", **self.tags}
        if self.train_run:
            tags["mlflow.parentRunId"] = self.train_run
        run_id = self.client.create_run(self.experiment_id, tags=tags).info.run_id
        self.runs[name] = run_id
        status = "FAILED"
        try:
            logger = MetricLogger(self.uri, run_id)
            logger.log_params(params)
            yield logger
            logger.flush()
            status = "FINISHED"
        finally:
            self.client.set_terminated(run_id, status)

    def publish(self, folder: Path, full: dict[str, dict], clean: dict[str, dict]) -> None:
        """The score-against-step PNGs in ``folder`` to every suite run and the training run, whose own charts also
        get the scores as ``eval.<task>.<metric>`` at this step."""
        for target in [*self.runs.values(), *([self.train_run] if self.train_run else [])]:
            for png in sorted(folder.glob("*_vs_step.png")):
                self.client.log_artifact(target, str(png), "eval")
        if self.train_run:
            logger = MetricLogger(self.uri, self.train_run)
            logger.log(flat_metrics(full, clean, prefix="eval."), self.ref.step)
            logger.flush()


def score_suites(model, encoding, runs: CheckpointRuns, suites: dict[str, list[str]], task_dirs: list[str | Path],
                 contamination: dict[str, dict[str, Any]], log, limit: int | None = None,
                 **kwargs: Any) -> tuple[dict[str, dict], dict[str, dict]]:
    """Score each suite (from ``runnable_suites``) in its own run; returns (full, clean) over every suite.

    task_dirs: the eval suite's folder and the contamination report's (with the ``_clean`` tasks); contamination:
    the report's ``tasks``. kwargs go to ``score_full_and_clean``.
    """
    full_all: dict[str, dict] = {}
    clean_all: dict[str, dict] = {}
    ref = runs.ref
    for suite, tasks in suites.items():
        params = {"tasks": tasks, "limit": limit, "checkpoint": str(ref.path), "step": ref.step}
        with runs.suite(suite, params) as logger:
            full, clean = score_full_and_clean(model, encoding, task_dirs, tasks, contamination, limit=limit, **kwargs)
            logger.log(flat_metrics(full, clean), ref.step)
        full_all.update(full)
        clean_all.update(clean)
        log.info(f"{ref.key}: suite {suite} scored ({', '.join(tasks)})")
    return full_all, clean_all


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("train_root", help="the training asset's folder, e.g. .kiln/storage/base_model")
    args = p.parse_args(argv)
    for r in discover(args.train_root):
        print(f"{r.key}\t{r.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
