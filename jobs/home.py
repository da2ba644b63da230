"""The Kiln home a command works in: a folder it can write, and one ``kiln run`` at a time in it.

``kiln run`` and ``kiln status`` keep Dagster's instance (sqlite), MLflow's database and every asset's output under
the home. Two runs started at once on one home would migrate the same databases and train into the same run folders,
so a run holds ``HOME/kiln.lock`` (an OS file lock, released when the process ends however it ends) and a second run
waits for it, saying which run it waits for.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

LOCK_NAME = "kiln.lock"
INIT_LOCK = "kiln.init.lock"  # held only while a command creates the home's databases (ready_databases)
READY = "databases.ready"  # written once both databases exist: later commands open them without the init lock
PRESET_RECORD = "preset.json"  # the preset of the home's latest kiln run: the UI's launchpad starts from it


def writable_home(home: Path) -> Path:
    """``home`` (created if need be) once every place a run or status writes there can be written: the folder, the
    Dagster instance's folder (``DAGSTER_HOME``) and its databases, MLflow's database and the output folders.
    Raises SystemExit with one line naming the first that cannot, and what to do."""
    dagster_home = Path(os.environ.get("DAGSTER_HOME") or home / "dagster")
    fix = (f"give --home a writable folder (a copy: cp -a {home} NEW), or make it writable (chmod -R u+w {home})")
    try:
        home.mkdir(parents=True, exist_ok=True)
        dagster_home.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"kiln: cannot create {e.filename or home} ({e.strerror}): the Kiln home holds Dagster's "
                         f"and MLflow's databases and every output; {fix}") from None
    written = [home, dagster_home, *(p for p in dagster_home.rglob("*") if p.is_dir() or p.suffix == ".db"),
               *(home / name for name in ("mlflow.db", "storage", "logs", "mlartifacts", LOCK_NAME))]
    for path in written:
        if path.exists() and not os.access(path, os.W_OK):
            raise SystemExit(f"kiln: {path} is not writable: kiln run and kiln status write Dagster's and MLflow's "
                             f"databases and the outputs in the Kiln home {home}; {fix}")
    ready_databases(home, dagster_home)
    return home


def ready_databases(home: Path, dagster_home: Path | None = None) -> None:
    """Create the home's Dagster instance (its run, event-log and schedule databases) and MLflow's database once,
    one process at a time: both migrate their schema on first open, and two commands doing that at once on a new
    home fail ("table already exists", alembic "expected to match one row") and can leave two alembic heads behind.
    Every command that opens them (run, sweep, status, ui) calls this first; once ``HOME/databases.ready`` exists it
    returns at once. A command that dies part way leaves no marker, so the next one finishes the creation."""
    if (home / READY).is_file():
        return
    dagster_home = Path(dagster_home or os.environ.get("DAGSTER_HOME") or home / "dagster")
    with open(home / INIT_LOCK, "a+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # seconds at most: the other command is creating the same databases
        if (home / READY).is_file():
            return
        import logging

        from dagster import DagsterInstance
        from dagster._core.instance.ref import InstanceRef
        from mlflow.tracking import MlflowClient

        quiet = [logging.getLogger(n) for n in ("alembic", "mlflow")]  # the migrations' INFO lines are not output
        levels = [log.level for log in quiet]
        for log in quiet:
            log.setLevel(logging.WARNING)
        try:  # the instance DagsterInstance.get() opens for this DAGSTER_HOME: sqlite runs, event logs, schedules
            with DagsterInstance.from_ref(InstanceRef.from_dir(str(dagster_home))) as instance:
                instance.get_runs(limit=1)
                instance.all_instigator_state()
            MlflowClient(f"sqlite:///{home / 'mlflow.db'}").search_experiments(max_results=1)
        finally:
            for log, level in zip(quiet, levels):
                log.setLevel(level)
        from kiln.common.files import atomic_write_text

        atomic_write_text(home / READY, f"created by pid {os.getpid()} at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")


def record_preset(home: Path, name: str, preset: dict) -> None:
    """Write ``HOME/preset.json`` (atomically): the name and op settings of the preset a ``kiln run`` used in this
    home, so that the Dagster UI's kiln_pipeline_job launchpad opens with them rather than the class defaults."""
    from kiln.common.files import atomic_write_json

    atomic_write_json(home / PRESET_RECORD, {"preset": name, "ops": preset.get("ops") or {}})


def recorded_preset(home: Path) -> dict | None:
    """{preset, ops} of the home's latest ``kiln run``; None when none was recorded or the record is unreadable
    (the launchpad then starts from the class defaults, and the reason is printed)."""
    import json

    path = home / PRESET_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(record, dict) or not isinstance(record.get("ops"), dict):
            raise ValueError("no ops mapping")
    except (OSError, ValueError) as e:
        _stderr(f"kiln: {path} is unreadable ({e}); the launchpad starts from the defaults (the next kiln run rewrites it)")
        return None
    return record


def lock_holder(home: Path) -> str | None:
    """Who holds the home's run lock now ("kiln run pid N, preset P, since T"), or None when no run does."""
    path = home / LOCK_NAME
    if not path.exists():
        return None
    with open(path, "a+", encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            return f.read().strip() or "another kiln run"
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def home_lock(home: Path, what: str, say: Callable[[str], None] = _stderr) -> Iterator[None]:
    """Hold the home's run lock inside the block; while another run holds it, say so once and wait."""
    with open(home / LOCK_NAME, "a+", encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another kiln run"
            say(f"kiln: {home} is in use by {holder}; waiting for it to end (runs on one home go one at a time; "
                "Ctrl-C stops waiting)")
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(f"kiln run pid {os.getpid()}, {what}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        try:
            yield
        finally:
            f.truncate(0)
            f.flush()


if __name__ == "__main__":  # scripts/ui.sh: python -m jobs.home HOME, before the servers open the databases
    writable_home(Path(sys.argv[1]).resolve())  # creates the databases (ready_databases) when they are new
