"""The Kiln home: runs started at once on one home go one at a time (a new home and an existing one) and leave it
usable; a home the user cannot write is one line naming it, for `kiln run` and `kiln status`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, subprocess_env
from jobs.cli import main
from jobs.home import LOCK_NAME, READY, home_lock, lock_holder, writable_home

RUN = ["run", "--preset", "smoke", "--select", "pretrained_model"]  # the cheapest asset: instance and MLflow all the same


def kiln(args: list[str], log: Path, wrap: list[str] = ()) -> subprocess.Popen:
    """``kiln ARGS`` in a subprocess (under the ``wrap`` command line), its stderr in ``log``."""
    env = {k: v for k, v in subprocess_env().items() if k != "DAGSTER_HOME"}  # the home's own instance
    with open(log, "w") as err:
        return subprocess.Popen([*wrap, sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=err)


def wait_for(log: Path, text: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.time() + timeout
    while text not in log.read_text():
        assert proc.poll() is None, f"exited {proc.returncode} before saying {text!r}: {log.read_text()}"
        assert time.time() < end, f"no {text!r} in {timeout}s: {log.read_text()}"
        time.sleep(0.2)


def test_runs_on_one_home_go_one_at_a_time_new_or_existing_and_the_home_stays_usable(tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    monkeypatch.setenv("DAGSTER_HOME", str(home / "dagster"))  # the in-process `kiln status` below reads the home's
    logs = [tmp_path / f"run{i}.err" for i in range(3)]
    waiting = f"kiln: {home} is in use by kiln run pid {os.getpid()}, the test, since "
    with home_lock(writable_home(home), "the test"):  # writable_home made the new home's databases, once
        assert (home / READY).is_file() and (home / "mlflow.db").is_file()
        made = {p: p.stat().st_mtime_ns for p in [home / "mlflow.db", *(home / "dagster").rglob("*.db")]}
        both = [kiln([*RUN, "--home", str(home)], log) for log in logs[:2]]  # two at once
        for proc, log in zip(both, logs):
            wait_for(log, waiting, proc)
        assert {p: p.stat().st_mtime_ns for p in made} == made  # waiting runs touch no database
    assert [p.wait(timeout=300) for p in both] == [0, 0], [log.read_text() for log in logs]
    assert lock_holder(home) is None and (home / LOCK_NAME).read_text() == ""
    assert main(["status", "--preset", "smoke", "--home", str(home)]) == 0  # the instance loads: one schema, one head
    out = capsys.readouterr()
    assert "is running" not in out.err and "pretrained_model" in out.out
    with home_lock(home, "the test"):  # an existing home: a run waits, and status says a run is going on
        third = kiln([*RUN, "--home", str(home)], logs[2])
        wait_for(logs[2], waiting, third)
        assert main(["status", "--preset", "smoke", "--home", str(home)]) == 0
        assert capsys.readouterr().err.startswith(f"kiln status: kiln run pid {os.getpid()}, the test, since ")
    assert third.wait(timeout=300) == 0, logs[2].read_text()


def alembic_heads(db: Path) -> list[str]:
    import sqlite3

    with sqlite3.connect(db) as c:
        return [r[0] for r in c.execute("select version_num from alembic_version")]


def test_commands_started_at_once_on_a_new_home_create_its_databases_once_and_all_succeed(tmp_path):
    """A status started while the first run creates a new home's databases, and two statuses at once, used to fail
    ("table already exists", alembic "expected to match one row") and could leave two alembic heads behind."""
    home = tmp_path / "home"
    logs = [tmp_path / f"{i}.err" for i in range(4)]
    status = ["status", "--preset", "smoke", "--home", str(home)]
    procs = [kiln([*RUN, "--home", str(home)], logs[0]), kiln(status, logs[1]), kiln(status, logs[2]),
             kiln(status, logs[3])]
    assert [p.wait(timeout=300) for p in procs] == [0] * 4, [log.read_text()[-2000:] for log in logs]
    assert (home / READY).read_text().startswith("created by pid ")
    dbs = [home / "mlflow.db", home / "dagster" / "history" / "runs.db", home / "dagster" / "schedules" / "schedules.db"]
    assert [len(alembic_heads(db)) for db in dbs] == [1, 1, 1]  # one schema version each: the home stays usable
    assert kiln(status, logs[0]).wait(timeout=120) == 0, logs[0].read_text()


def test_a_home_the_user_cannot_write_is_one_line_naming_it(tmp_path):
    home = tmp_path / "home"
    (home / "dagster").mkdir(parents=True)
    (home / "storage").mkdir()
    if os.geteuid() == 0:  # root writes anywhere: mount the home read-only in a mount namespace of the command's own
        wrap = ["unshare", "--mount", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(home)]
    else:
        wrap = []
        for p in (home / "dagster", home / "storage", home):
            p.chmod(0o555)
    try:
        for args in (["status", "--preset", "smoke"], RUN):
            log = tmp_path / f"{args[0]}.err"
            assert kiln([*args, "--home", str(home)], log, wrap).wait(timeout=120) == 1, log.read_text()
            err = log.read_text().splitlines()
            assert len(err) == 1 and err[0].startswith(f"kiln: {home} is not writable: kiln run and kiln status write "), err
            assert err[0].endswith(f"give --home a writable folder (a copy: cp -a {home} NEW), or make it writable "
                                   f"(chmod -R u+w {home})")
    finally:
        for p in (home, home / "dagster", home / "storage"):
            p.chmod(0o755)
    assert not (home / LOCK_NAME).exists() and not any((home / "dagster").iterdir())
