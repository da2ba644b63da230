"""``kiln run``: materialize a preset's assets in a home, with the console's lines and a failure's reasons first."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any


from jobs.commands._common import add_home, add_preset, add_verbose, home_of
from jobs.console import format_seconds
from jobs.errors import config_error_line, innermost_error
from jobs.presets import load_preset, run_selection, select_config


def add_parser(sub: Any) -> None:
    run = sub.add_parser("run", help="materialize assets with a preset")
    add_preset(run, help="name under conf/presets (smoke, demo, gpt2-124m-1gpu, ...) or a YAML path")
    run.add_argument("--select", default="", help="comma-separated asset names (default: all)")
    add_home(run)
    add_verbose(run, "print every Dagster event and library warning on the terminal (not only in the run's log "
                     "file), and every failed step's full trace")
    run.set_defaults(fn=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from jobs.home import home_lock, writable_home

    home = home_of(args)
    with home_lock(writable_home(home), f"preset {args.preset}"):
        return run_in_home(args, home)


def run_in_home(args: argparse.Namespace, home: Path) -> int:
    """``kiln run`` in a writable home whose run lock this process holds."""
    from dagster import AssetKey, DagsterInstance, DagsterInvalidConfigError

    from jobs.definitions import ALL_ASSETS, OPT_IN, complete_resource_config, make_definitions, make_resources
    from jobs.home import record_preset

    from jobs.preflight import preflight

    defs = make_definitions(home)
    names = [a.key.to_user_string() for a in ALL_ASSETS]
    preset = load_preset(args.preset, keep_opt_in=True)
    opt_in = [n for n in preset.get("opt_in") or [] if n in OPT_IN]  # an unknown one: preflight's refusal below
    keys = run_selection(names, opt_in, args.select)
    bad = [k for k in keys if k not in names]
    if bad:
        raise SystemExit(f"kiln: pick --select from {', '.join(names)}: unknown asset(s) {bad}")
    # the checks kiln status makes too (jobs.preflight): names on the whole preset (select_config drops the ops
    # outside the selection), types, the files the selected assets read, the device
    refused = preflight(preset, home, keys)
    preset.pop("opt_in", None)
    if refused:
        print(f"kiln: preset {args.preset}: {refused}", file=sys.stderr)
        return 2
    job = defs.resolve_job_def("kiln_pipeline_job")
    run_config = complete_resource_config(select_config(preset, keys), make_resources(home))
    from dagster._core.utils import make_new_run_id

    from jobs.console import RunConsole

    run_id = make_new_run_id()
    console = RunConsole(home / "logs" / f"{run_id}-events.log", keys, verbose=args.verbose)
    run_config = {**run_config, "loggers": {**(run_config.get("loggers") or {}), **console.loggers_config()}}
    print(f"kiln: run {run_id}, preset {args.preset}, {len(keys)} assets; full log: {console.log_path}", flush=True)
    start = time.time()
    try:  # Dagster's progress log goes to stdout, so that stderr holds kiln's own lines, a failure's first
        with console, run_output(console), DagsterInstance.get() as instance:
            result = job.with_logger_defs(console.logger_defs()).execute_in_process(
                run_config=run_config, instance=instance, raise_on_error=False, run_id=run_id,
                asset_selection=[AssetKey(k) for k in keys], tags={"kiln/preset": args.preset})
    except DagsterInvalidConfigError as e:  # refused before the run: a typo or a wrong type in the preset
        print(f"kiln: preset {args.preset}: {config_error_line(e, job)}", file=sys.stderr)
        return 2
    took = time.time() - start
    record_preset(home, args.preset, preset)  # the UI's launchpad opens with it
    if not result.success:
        report_failure(result, home, args.verbose)
        print(f"kiln: run {result.run_id} FAILED after {took:.0f}s", file=sys.stderr)
        return 1
    print(f"kiln: run {result.run_id} materialized {len(keys)} assets in {format_seconds(took)} (preset {args.preset})")
    summarize(result, keys)
    print(f"Every event of the run: {console.log_path}\n"
          "Open the UI with: make ui   (Dagster at http://127.0.0.1:3000, MLflow at http://127.0.0.1:5000)")
    return 0


@contextlib.contextmanager
def run_output(console):
    """Where what libraries print during a run goes: with --verbose to stdout (stderr keeps kiln's own lines, a
    failure's first); otherwise into the run's log file, so that the terminal shows only the console's lines."""
    if console.verbose:
        with contextlib.redirect_stderr(sys.stdout):
            yield
        return
    console.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(console.log_path, "a", encoding="utf-8", buffering=1) as log, \
            contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        yield


def report_failure(result, home: Path, verbose: bool) -> Path:
    """Say on stderr, first, why each failed step failed (one line each: step, error class, message), then where
    the full traces are: ``<home>/logs/<run id>.log`` (written atomically); ``verbose`` prints the traces too."""
    from kiln.common.files import atomic_write_text

    failed = [(ev.step_key, ev.event_specific_data.error) for ev in result.all_events if ev.is_step_failure]
    for step, error in failed:
        cls, message = innermost_error(error)
        if cls == "DagsterAssetCheckFailedError":  # the check's own lines above say why
            print(f"kiln: {step} failed: {message.split(': ', 1)[-1]} (why: the check's lines above); the asset it "
                  "checks is materialized, what depends on it did not run", file=sys.stderr)
            continue
        print(f"kiln: {step} failed: {cls}: {message}", file=sys.stderr)
    log = home / "logs" / f"{result.run_id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(log, "".join(f"== step {step} failed ==\n{error.to_string()}\n" for step, error in failed))
    print(f"kiln: full trace{'s' * (len(failed) > 1)} in {log}", file=sys.stderr)
    if verbose:
        for step, error in failed:
            print(f"kiln: step {step} failed:\n{error.to_string()}", file=sys.stderr)
    return log


def summarize(result, keys: list[str]) -> None:
    """What the run achieved: the base model's loss against a uniform guess, each task's primary score beside
    chance, and where the release is."""
    import math

    from jobs.console import score_line

    if "base_model" in keys and "tokenizer" in keys:
        base, tok = result.output_for_node("base_model"), result.output_for_node("tokenizer")
        print(f"  base model validation loss {base['initial_val_loss']:.3f} -> {base['final_val_loss']:.3f} nats/token "
              f"(a uniform guess over {tok['n_vocab']} tokens scores {math.log(tok['n_vocab']):.3f})")
    if "eval_scores" in keys:
        for task, row in result.output_for_node("eval_scores")["tasks"].items():
            print(f"  {task:22s} {score_line(task, row)}")
    if "release_bundle" in keys:
        print(f"  release bundle {result.output_for_node('release_bundle')['dir']}")
