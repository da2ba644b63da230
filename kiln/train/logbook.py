"""The run logbook: every attempt at a training run, across crashes, kills, preemptions, torchrun restarts,
relaunches and spike rollbacks.

Rank 0 writes them to the run journal (kiln.train.journal): a ``start`` per attempt, ``spike`` events, an ``end``
with how it ended. Attempt ids climb as ``<launch>.<n>``: a new launch (a materialization, a sbatch job, a
``python -m kiln.train`` command) raises the first number, a torchrun restart or a rollback within it the second.
``attempts(run_dir)`` reads it back as one row per attempt (``python -m kiln.train.logbook RUN_DIR`` prints them);
an attempt with no ``end`` line was killed (SIGKILL, out of memory, a lost node), its last step read from its
process's last goodput ``beat`` in the same journal.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from pathlib import Path
from typing import Any

from kiln.common.metrics import flatten
from kiln.train.journal import JOURNAL, Journal, read

OUTCOMES = ("completed", "preempted", "crashed", "killed", "rolled_back")
# job fields that differ between attempts without changing what is trained
UNCOMPARED = ("out_dir", "mlflow_run_id", "mlflow_tracking_uri", "train_files", "val_files")


def launch_id() -> str:
    """Who launched this process: the launcher's id (KILN_LAUNCH_ID), else torchrun's run id (the same across its
    restarts), else this process alone."""
    return (os.environ.get("KILN_LAUNCH_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
            or f"pid-{os.getpid()}-{time.time():.3f}")


def changes(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, list]:
    """{key: [old, new]} for each flat config key whose value differs (a key on one side only included)."""
    if old is None:
        return {}
    return {k: [old.get(k), new.get(k)] for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}


def _attempt_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if "attempt" in r]


class Logbook:
    """The attempts' writer, into this process's journal (a no-op on every rank but 0). ``begin`` opens an
    attempt, ``event`` notes a spike or a skipped update, ``end`` closes the attempt with one of OUTCOMES."""

    def __init__(self, journal: Journal):
        self.journal = journal
        self.attempt: str | None = None
        self.started: float | None = None

    def begin(self, step: int, how: str, job: dict[str, Any], env: dict[str, Any], resumed_from: str | None = None,
              t: float | None = None) -> str:
        """Open an attempt at ``step`` (``how``: fresh, resume or rollback); return its id."""
        if not self.journal.enabled:
            return ""
        records = _attempt_records(self.journal.read())
        starts = [r for r in records if r.get("event") == "start"]
        prev = starts[-1] if starts else None
        launch = launch_id()
        if prev and (how == "rollback" or prev.get("launch") == launch):
            major, minor = (int(x) for x in prev["attempt"].split("."))
            self.attempt = f"{major}.{minor + 1}"
        else:
            self.attempt = f"{int(prev['attempt'].split('.')[0]) + 1 if prev else 1}.0"
        config = {**{k: v for k, v in flatten(job).items() if not k.startswith(UNCOMPARED)}, **env}
        if t is None or (records and t < records[-1]["t"]):  # a process that ran earlier attempts starts this one now
            t = time.time()
        self.started = t
        self.journal.write({"event": "start", "attempt": self.attempt, "t": self.started, "step": step, "how": how,
                            "resumed_from": resumed_from, "launch": launch, "config": config,
                            "changed": changes(prev.get("config") if prev else None, config),
                            "slurm_job_id": os.environ.get("SLURM_JOB_ID")})
        return self.attempt

    def event(self, kind: str, step: int, **fields: Any) -> None:
        self.journal.write({"event": "spike", "attempt": self.attempt, "t": time.time(), "kind": kind, "step": step,
                            **fields})

    def end(self, outcome: str, step: int, **fields: Any) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"logbook outcome {outcome!r} is not one of {', '.join(OUTCOMES)}")
        self.journal.write({"event": "end", "attempt": self.attempt, "t": time.time(), "outcome": outcome,
                            "step": step, **fields})


def _clock(t: float | None) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if t else ""


def _row(start: dict, end: dict | None, spikes: list[dict], nxt: dict | None, beats: dict) -> dict[str, Any]:
    beat = beats.get(start.get("session"), {})
    if end is not None:
        outcome, reached, t_end = end["outcome"], end["step"], end["t"]
    else:  # no end line: the process was killed; how far it got is in its last goodput beat
        outcome, reached, t_end = "killed", max(start["step"], beat.get("step", start["step"])), beat.get("t")
    if outcome == "completed" or outcome == "preempted":
        lost = reached - end.get("saved_step", reached) if end else 0
    elif outcome == "rolled_back":
        lost = reached - end["to_step"]
    else:
        lost = max(0, reached - nxt["step"]) if nxt is not None else None
    skipped = sum(s.get("skipped_batches", 0) for s in spikes) + (end or {}).get("skipped_batches", 0)
    note = (end or {}).get("error") or (end or {}).get("signal") or ""
    if outcome == "rolled_back":
        note = f"{end.get('reason', '')}; back to step {end['to_step']}"
    hours = (t_end - start["t"]) / 3600 if t_end else 0.0
    return {"attempt": start["attempt"], "started": _clock(start["t"]), "ended": _clock(t_end), "outcome": outcome,
            "how": start["how"], "from_step": start["step"], "to_step": reached, "steps_lost": lost,
            "spikes": len(spikes) + (outcome == "rolled_back"), "skipped_batches": skipped,
            "config_changes": ", ".join(f"{k}: {a} -> {b}" for k, a, b in
                                        ((k, *v) for k, v in start.get("changed", {}).items())),
            "note": note[:200], "world_size": start.get("config", {}).get("world_size", 1),
            "device": start.get("config", {}).get("device", "cpu"), "hours": hours,
            "energy_j": (end or {}).get("energy_j"), "slurm_job_id": start.get("slurm_job_id") or ""}


def attempts(run_dir: Path) -> list[dict[str, Any]]:
    """One row per attempt, oldest first: id, times (UTC), outcome, steps from and to, steps lost (redone by the next
    attempt), spikes, skipped batches, config changes from the previous attempt, and what ended it."""
    records = read(run_dir)
    beats = {r["session"]: r for r in records if r.get("event") in ("ready", "beat")}  # each process's last
    records = _attempt_records(records)
    starts = [r for r in records if r.get("event") == "start"]
    rows = []
    for i, s in enumerate(starts):
        mine = [r for r in records if r.get("attempt") == s["attempt"]]
        end = next((r for r in mine if r.get("event") == "end"), None)
        spikes = [r for r in mine if r.get("event") == "spike"]
        rows.append(_row(s, end, spikes, starts[i + 1] if i + 1 < len(starts) else None, beats))
    return rows


SHOWN = ("attempt", "started", "ended", "outcome", "from_step", "to_step", "steps_lost", "spikes", "skipped_batches",
         "config_changes", "note")


def format_table(rows: list[dict[str, Any]], columns: tuple[str, ...] = SHOWN) -> str:
    """The attempts as a markdown table (what the asset metadata, MLflow and ``kiln logbook`` show)."""
    if not rows:
        return "_no attempts recorded_\n"
    cell = lambda v: "" if v is None else str(v).replace("|", "/")  # noqa: E731
    return "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
                     + ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]) + "\n"


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts for a model card: attempts, each outcome, steps lost, spikes and skipped batches."""
    out: dict[str, Any] = {"attempts": len(rows), **{o: sum(r["outcome"] == o for r in rows) for o in OUTCOMES}}
    out["steps_lost"] = sum(r["steps_lost"] or 0 for r in rows)
    out["spikes"] = sum(r["spikes"] for r in rows)
    out["skipped_batches"] = sum(r["skipped_batches"] for r in rows)
    return out


def run_folders(path: str | Path) -> list[tuple[str, Path]]:
    """(stage, run folder) of each training run behind ``path``: a run folder, a checkpoint in one, or a release
    bundle (its kiln.json names the checkpoint of every stage: base model, then SFT, DPO and RL, and for a PPO
    release the reward model and PPO)."""
    path = Path(path)
    if (path / "kiln.json").is_file():
        info = json.loads((path / "kiln.json").read_text())
        stages = [("base_model", info.get("training", {}).get("base_model", {}))]
        stages += [(s.get("stage", "?"), s) for s in info.get("post_training", [])]
        return [(name, Path(s["checkpoint"]).parent.parent) for name, s in stages if s.get("checkpoint")]
    if (path / JOURNAL).is_file():
        return [(path.name, path)]
    if (path.parent.parent / JOURNAL).is_file():  # <run folder>/checkpoints/step_N
        return [(path.parent.parent.name, path.parent.parent)]
    raise FileNotFoundError(f"{path}: neither a run folder with {JOURNAL}, a checkpoint in one, nor a release bundle "
                            "(kiln.json); give .kiln/storage/<asset>/<run> or .kiln/storage/release_bundle/<version>")


def main(argv: list[str] | None = None) -> int:
    """``kiln logbook RUN_OR_RELEASE [--json]``: the attempts of each training run behind it, as tables."""
    import argparse

    p = argparse.ArgumentParser(prog="kiln logbook", description=main.__doc__)
    p.add_argument("run", help="run folder (.kiln/storage/base_model/<key>), checkpoint, or release bundle folder")
    p.add_argument("--json", action="store_true", help="every attempt's row as JSON")
    a = p.parse_args(argv)
    try:
        folders = run_folders(a.run)
    except (FileNotFoundError, json.JSONDecodeError) as e:
        raise SystemExit(f"kiln logbook: {e}") from e
    if a.json:
        print(json.dumps({name: attempts(folder) for name, folder in folders}, indent=2))
        return 0
    for name, folder in folders:
        rows = attempts(folder)
        s = summary(rows)
        print(f"{name} ({folder}): {s['attempts']} attempts, "
              + ", ".join(f"{s[o]} {o.replace('_', ' ')}" for o in OUTCOMES if s[o])
              + f"; {s['steps_lost']} steps lost, {s['spikes']} spikes, {s['skipped_batches']} batches skipped\n")
        print(format_table(rows))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
