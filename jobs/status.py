"""``kiln status``: each asset's latest version and time, and what the next run with a preset would do with it.

Run: ``kiln status --preset smoke [--json]``. Each asset is reused, resumed (training continues from its newest good
checkpoint) or recomputed, with the reasons: its code version, a config field with its old and new value, an upstream
asset that recomputes or whose data version moved (Dagster's staleness), or a recorded output whose files no longer
match (the same check ``kiln run`` makes before reusing, resources.tracking.MlflowResource.find_reusable, here without
touching any file); and about how long it would take (the last computing run's duration, else the training plan).
A training asset whose newest attempt failed or was killed after writing checkpoints resumes: its run folder (keyed by
the config, inputs and code version the next run shares) holds a checkpoint that verifies, and the steps left take the
last run's time per step (else the attempt's own, else the plan's).
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TRAINING = ("base_model", "sft_model", "dpo_model", "rl_model")  # recomputing these resumes from a checkpoint
# optional inputs an asset reads only under some of its config: (asset, input) -> whether its next config reads it;
# an unread one's changes leave the asset as it is (dpo_model and reward_model read judged_preferences only when
# their feedback is judged or mixed)
READ_WHEN = {("dpo_model", "judged_preferences"): lambda config: config.get("feedback", "checkable") != "checkable",
             ("reward_model", "judged_preferences"): lambda config: config.get("feedback", "checkable") != "checkable"}


@dataclass
class AssetStatus:
    asset: str
    version: str | None  # data version of the latest materialization (None: never materialized)
    materialized_at: str | None  # its time, ISO 8601 UTC
    action: str  # "reuse", "resume", "recompute", "compute" (never materialized) or "skip" (opt-in, not selected)
    reasons: list[str] = field(default_factory=list)
    estimate_s: float | None = None  # seconds the next run would spend on it (None: unknown)
    estimate_from: str = ""  # "last run", "training plan", "reuse"
    roots: list[str] = field(default_factory=list)  # the assets whose own change makes this one run
    next_version: str | None = None  # the data version the next run gives it when it is reused


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """{"clean.min_words": 50, ...} from nested config mappings."""
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def resolved_ops(job, run_config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{op: its config with every default filled in}, as Dagster resolves ``run_config`` for ``job``."""
    from dagster._config import process_config

    result = process_config(job.run_config_schema.config_type, {"ops": run_config.get("ops") or {}})
    if not result.success:
        raise SystemExit(f"kiln status: fix the preset first: {result.errors[0].message}")
    return {name: (block or {}).get("config") or {} for name, block in result.value["ops"].items()}


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``config clean.min_words 50 -> 80`` for each field whose value differs."""
    a, b = flatten(old), flatten(new)
    return [f"config {k} {json.dumps(a.get(k), default=str)} -> {json.dumps(b.get(k), default=str)}"
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


class StatusReader:
    """Reads the Dagster instance and MLflow of one Kiln home, and decides asset by asset in graph order."""

    def __init__(self, defs, instance, run_config: dict[str, Any], mlflow, verify: bool = False):
        self.defs, self.instance, self.mlflow = defs, instance, mlflow
        self.verify = verify  # hash every recorded file before saying "reuse" (kiln status --verify)
        self.job = defs.resolve_job_def("kiln_pipeline_job")
        self.graph = defs.resolve_asset_graph()
        self.new_ops = resolved_ops(self.job, run_config)
        self.client = mlflow.client()
        exp = self.client.get_experiment_by_name(mlflow.experiment)
        self.experiment_id = exp.experiment_id if exp is not None else None
        self.decided: dict[str, AssetStatus] = {}
        storage = ((run_config.get("resources") or {}).get("storage") or {}).get("config") or {}
        root = storage.get("root") or getattr(defs.resources.get("storage"), "root", None)
        self.storage_root = str(Path(root).resolve()) if root else None  # a copied home's records move here

    def status(self, names: list[str], skipped: list[str] = ()) -> list[AssetStatus]:
        """Each asset's status in ``names`` order (every asset after its upstream); ``skipped``: opt-in assets the
        preset does not run (jobs.definitions.OPT_IN), which kiln run leaves out."""
        for name in names:
            self.decided[name] = self.skip(name) if name in skipped else self.decide(name)
        return [self.decided[n] for n in names]

    def skip(self, name: str) -> AssetStatus:
        ev = self.instance.get_latest_materialization_event(_key(name))
        when = (dt.datetime.fromtimestamp(ev.timestamp, dt.timezone.utc).isoformat(timespec="seconds")
                if ev is not None else None)
        version = ev.asset_materialization.tags.get("dagster/data_version") if ev is not None else None
        return AssetStatus(name, version, when, "skip", [f"opt-in: the preset's opt_in does not list it (kiln run "
                                                         f"--select {name} runs it)"])

    def decide(self, name: str) -> AssetStatus:
        from dagster import AssetKey

        from assets.pretrained import FROM_SCRATCH

        key = AssetKey(name)
        ev = self.instance.get_latest_materialization_event(key)
        if ev is None:
            st = AssetStatus(name, None, None, "compute", ["never materialized"], *self.estimate(name, None))
            return self.resumed(name, st, None)
        tags, meta = ev.asset_materialization.tags, ev.asset_materialization.metadata
        when = dt.datetime.fromtimestamp(ev.timestamp, dt.timezone.utc).isoformat(timespec="seconds")
        st = AssetStatus(name, tags.get("dagster/data_version"), when, "recompute")
        own, upstream = self.changes(name, ev)
        st.roots = sorted(({name} if own else set()) | {r for p in upstream for r in self.decided[p].roots})
        st.reasons = own + [f"upstream {r} changes: {self.decided[r].reasons[0]}" for r in st.roots if r != name]
        if name == "pretrained_model" and not st.reasons and not (self.new_ops.get(name) or {}).get("path"):
            # nothing to import: the asset reruns in milliseconds with its fixed version, so nothing below changes
            st.action, st.reasons, st.roots = "reuse", [f"inputs, config and code unchanged: no path, so nothing to import (fixed version {FROM_SCRATCH['version']})"], []
            st.estimate_s, st.estimate_from, st.next_version = 0.0, "reuse", FROM_SCRATCH["version"]
            return st
        earlier = self.earlier_match(name, ev) if own and not upstream else None
        candidate = earlier or (ev if not st.reasons else None)
        if candidate is not None:
            found, problems = self.reusable(name, candidate.asset_materialization.metadata)
            if found:
                said = "unchanged since" if candidate is ev else "the same as an earlier run,"
                st.action, st.reasons, st.roots = "reuse", [f"inputs, config and code {said} MLflow run {found[:8]}"], []
                st.estimate_s, st.estimate_from = 0.0, "reuse"
                st.next_version = candidate.asset_materialization.tags.get("dagster/data_version")
                return st
            if candidate is ev:
                st.reasons, st.roots = problems, [name]
                st.action = "resume" if name in TRAINING else "recompute"
        st.estimate_s, st.estimate_from = self.estimate(name, meta)
        return self.resumed(name, st, ev)

    def resumed(self, name: str, st: AssetStatus, ev) -> AssetStatus:
        """``st`` turned to "resume" when an unfinished attempt of training asset ``name`` after ``ev`` left a good
        checkpoint in the run folder the next run trains in, with the time its remaining steps take."""
        if name not in TRAINING:
            return st
        attempt = self.leftover(name, ev.timestamp if ev is not None else 0.0)
        if attempt is None:
            return st
        st.action = "resume"
        st.reasons.append(f"a {attempt.state} attempt left step {attempt.step} of {attempt.total} (checkpoint verified)")
        seconds, where = self.remaining(name, attempt, ev)
        if seconds is not None:
            st.estimate_s, st.estimate_from = seconds, where
        return st

    def leftover(self, name: str, after: float) -> "Attempt | None":
        """The newest unfinished attempt of ``name`` (a checkpoint, no result: a failed or killed materialization)
        that the next run continues, as its run folder is keyed by the same config, inputs and code version
        (kiln.train.launch.RunSpec.key, resources.torchrun's training_run): one whose recorded run had the next run's
        config, inputs and code version (a run recorded before runs were tagged with it trained in a folder named
        without it, which the next run does not continue), however old
        (a setting changed and changed back finds it again, as the run does), or, where no run is on record, one
        whose checkpoint is newer than ``after`` (the last materialization). None when there is none or its
        newest good checkpoint fails verification."""
        from kiln.train.checkpoint import list_checkpoints

        unfinished = []
        for folder in _run_folders(self.storage_dir(name)):
            found = list_checkpoints(folder / "checkpoints")
            if found and not (folder / "result.json").exists():
                unfinished.append(((found[-1] / "meta.json").stat().st_mtime, folder))
        for when, folder in sorted(unfinished, key=lambda x: x[0], reverse=True):
            attempt = self._attempt(name, folder, when, after)
            if attempt is not None:
                return attempt
        return None

    def _attempt(self, name: str, folder: Path, when: float, after: float) -> "Attempt | None":
        """The attempt in run folder ``folder`` (newest checkpoint at ``when``) if the next run continues it."""
        from kiln.train.checkpoint import latest_good_checkpoint, step_of

        job = _read_json(folder / "job.json")
        run = self._mlflow_run(job.get("mlflow_run_id"))
        dagster_run = self.instance.get_run_by_id(run.data.tags.get("dagster.run_id", "")) if run is not None else None
        if dagster_run is None:
            if when <= after:
                return None  # no record of its settings: only one newer than the last materialization is its retry
        elif config_changes(resolved_ops(self.job, dagster_run.run_config).get(name, {}), self.new_ops.get(name, {})):
            return None  # the next run trains with other settings, in another run folder
        if run is not None and run.data.tags.get("dagster.code_version") != self.code_version(name):
            return None  # made by another code version (or before run folders were keyed by it): not continued
        good = latest_good_checkpoint(folder / "checkpoints", log=lambda _m: None)
        if good is None or not job.get("max_steps"):
            return None
        attempt = Attempt(folder, step_of(good), int(job["max_steps"]), "unfinished", None, when)
        if run is not None:
            attempt.state = {"FAILED": "failed", "KILLED": "killed", "RUNNING": "killed"}.get(run.info.status, "unfinished")
            attempt.started = run.info.start_time / 1000 if run.info.start_time else None
        if not self.same_inputs(name, attempt.started or when):
            return None
        return attempt

    def parents(self, name: str) -> list[str]:
        """The upstream assets of ``name`` that its next run reads (READ_WHEN leaves out an optional one its config
        does not use), sorted."""
        config = self.new_ops.get(name) or {}
        return sorted(p for p in (k.to_user_string() for k in self.graph.get(_key(name)).parent_keys)
                      if READ_WHEN.get((name, p), lambda _c: True)(config))

    def same_inputs(self, name: str, at: float) -> bool:
        """True when every upstream asset of ``name`` is reused with the data version it had at time ``at``."""
        for parent in self.parents(name):
            up = self.decided.get(parent)
            if up is None:
                continue
            if up.action != "reuse":
                return False
            then = next((r.event_log_entry for r in self.instance.fetch_materializations(_key(parent), limit=25).records
                         if r.event_log_entry.timestamp <= at), None)
            if then is None or then.asset_materialization.tags.get("dagster/data_version") != up.next_version:
                return False
        return True

    def remaining(self, name: str, attempt: "Attempt", ev) -> tuple[float | None, str]:
        """Seconds for the steps an attempt left: at the last finished run's rate, else the attempt's own (its MLflow
        run's start to its newest checkpoint), else the training plan's."""
        left = attempt.total - attempt.step
        if ev is not None:
            meta = ev.asset_materialization.metadata
            seconds, where = self.estimate(name, meta)
            steps = _plain(meta.get("steps"))
            if where == "last run" and isinstance(steps, (int, float)) and steps > 0:
                return seconds / steps * left, "last run's rate"
        if attempt.started and attempt.step > 0 and attempt.checkpoint_time > attempt.started:
            return (attempt.checkpoint_time - attempt.started) / attempt.step * left, "the attempt's rate"
        seconds, where = self.estimate(name, None)
        return (seconds * left / attempt.total, where) if seconds is not None else (None, "")

    def storage_dir(self, name: str) -> Path:
        """The local folder holding ``name``'s run folders (KilnStorageResource.path, without creating it)."""
        storage = self.defs.resources.get("storage")
        if storage is None:
            return Path("/nonexistent")
        return Path(storage.cache if storage.durable else storage.root).expanduser().resolve() / name

    def _mlflow_run(self, run_id: str | None):
        if not run_id:
            return None
        try:
            return self.client.get_run(run_id)
        except Exception:  # deleted run, other tracking store
            return None

    def earlier_match(self, name: str, latest):
        """An earlier materialization of ``name`` made with the next run's code, config and upstream versions (the
        next run reuses it, as run reuse looks past the latest one), or None."""
        records = self.instance.fetch_materializations(_key(name), limit=25).records
        for rec in records:
            ev = rec.event_log_entry
            if ev.run_id != latest.run_id and self.changes(name, ev) == ([], []):
                return ev
        return None

    def code_version(self, name: str) -> str | None:
        """The code version the next run of ``name`` runs under."""
        return self.graph.get(_key(name)).code_version

    def changes(self, name: str, ev) -> tuple[list[str], list[str]]:
        """(why the recorded output of ``name`` no longer answers the next run: code, config, an upstream data
        version, reuse off; the upstream assets that will run first)."""
        tags = ev.asset_materialization.tags
        reasons, upstream = [], []
        code = self.code_version(name)
        if tags.get("dagster/code_version") != code:
            reasons.append(f"code version {tags.get('dagster/code_version')} -> {code}")
        run = self.instance.get_run_by_id(ev.run_id)
        if run is not None:
            reasons += config_changes(resolved_ops(self.job, run.run_config).get(name, {}), self.new_ops.get(name, {}))
        for parent in self.parents(name):
            up = self.decided.get(parent)
            if up is None:
                continue
            if up.action != "reuse":
                upstream.append(parent)
            elif tags.get(f"dagster/input_data_version/{parent}") not in (None, up.next_version):
                reasons.append(f"upstream {parent} data version {tags[f'dagster/input_data_version/{parent}']} -> "
                               f"{up.next_version}")
        if not self.mlflow.reuse_runs:
            reasons.append("resources.mlflow.config.reuse_runs is false")
        return reasons, upstream

    def reusable(self, name: str, meta: dict[str, Any]) -> tuple[str | None, list[str]]:
        """(MLflow run whose recorded output the next run would reuse, or None; why not) via find_reusable."""
        run_id = _plain(meta.get("mlflow_run_id"))
        if not run_id or self.experiment_id is None:
            return None, ["no MLflow run is recorded for its latest materialization"]
        try:
            key = self.client.get_run(run_id).data.tags.get("kiln.reuse_key")
        except Exception as e:  # deleted run, other tracking store
            return None, [f"MLflow run {run_id} is not in {self.mlflow.resolved_uri()} ({type(e).__name__})"]
        if not key:
            return None, ["its output is never reused (no reuse key)"]
        said: list[str] = []
        found = self.mlflow.find_reusable(self.client, self.experiment_id, name, key, said.append, set_aside=False,
                                          root=self.storage_root, full=self.verify)
        if found:
            return found[0], []
        return None, [m.split(": ", 1)[-1].split(". Recomputing")[0] for m in said] or ["no finished run recorded its output"]

    def estimate(self, name: str, meta: dict[str, Any] | None) -> tuple[float | None, str]:
        """Seconds of the run that last computed ``name`` (not a reuse), else the training plan's estimate."""
        if meta is not None:
            run_id = _plain(meta.get("reused_mlflow_run_id")) or _plain(meta.get("mlflow_run_id"))
            try:
                info = self.client.get_run(run_id).info
                if info.end_time and info.start_time:
                    return (info.end_time - info.start_time) / 1000, "last run"
            except Exception:  # no such run: fall through
                pass
        if name == "base_model":
            plan = self.instance.get_latest_materialization_event(_key("training_plan"))
            hours = _plain(plan.asset_materialization.metadata.get("estimated_hours")) if plan else None
            if isinstance(hours, (int, float)):
                return hours * 3600, "training plan"
        return None, ""


@dataclass
class Attempt:
    """An unfinished training attempt's run folder, its newest good checkpoint and how far it got."""

    folder: Path
    step: int  # the newest verified checkpoint's step
    total: int  # the job's max_steps
    state: str  # "failed", "killed" or "unfinished" (its MLflow run's status)
    started: float | None  # its MLflow run's start, seconds since the epoch
    checkpoint_time: float  # when its newest checkpoint was written


def _run_folders(parent: Path) -> list[Path]:
    return sorted(p for p in parent.iterdir() if p.is_dir() and not p.name.startswith(".")) if parent.is_dir() else []


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _key(name: str):
    from dagster import AssetKey

    return AssetKey(name)


def _plain(v: Any) -> Any:
    return getattr(v, "value", v)


def format_status(rows: list[AssetStatus]) -> str:
    """A table for people: asset, version, time, action, estimate, then the reasons indented below."""
    from jobs.console import format_seconds

    lines = [f"{'asset':<21} {'version':<17} {'materialized':<20} {'next run':<10} time"]
    total = 0.0
    for r in rows:
        when = r.materialized_at.replace("T", " ")[:16] if r.materialized_at else "-"
        est = ("" if r.action in ("reuse", "skip") else "unknown" if r.estimate_s is None
               else "~" + format_seconds(r.estimate_s))
        total += r.estimate_s or 0.0 if r.action != "skip" else 0.0
        lines.append(f"{r.asset:<21} {r.version or '-':<17} {when:<20} {r.action:<10} {est}"
                     + (f" ({r.estimate_from})" if r.estimate_from not in ("", "reuse", "last run") else ""))
        if r.action != "reuse":
            lines += [f"    {why}" for why in r.reasons]
    running = [r for r in rows if r.action not in ("reuse", "skip")]
    unknown = [r.asset for r in running if r.estimate_s is None]
    skipped = sum(r.action == "skip" for r in rows)
    selected = len(rows) - skipped
    took = f"about {format_seconds(total)}" + (f" plus {', '.join(unknown)} (never run: no estimate)" if unknown else "")
    lines.append((f"{len(running)} of {selected} assets would run, {took} (from the last runs' durations); one below "
                  "a change is reused after all when its inputs come out byte-identical" if running
                  else f"nothing to run: all {selected} assets would be reused")
                 + (f"; {skipped} opt-in assets not selected" if skipped else ""))
    return "\n".join(lines) + "\n"


def status_json(rows: list[AssetStatus]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=2)
