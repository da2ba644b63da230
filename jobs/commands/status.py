"""``kiln status``: what the next run with a preset would reuse, resume or recompute, why, and how long."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any


from jobs.commands._common import add_home, add_preset, open_home
from jobs.presets import load_preset, preset_mlflow, run_selection


def add_parser(sub: Any) -> None:
    stat = sub.add_parser("status", help="what the next run with a preset would reuse, resume or recompute, why, and how long")
    add_preset(stat)
    add_home(stat, "the Kiln home whose runs to read")
    stat.add_argument("--json", action="store_true", help="one record per asset as JSON, for scripts")
    stat.add_argument("--verify", action="store_true", help="hash every file an output to be reused recorded, not "
                      "only those whose size or time changed (a damaged one makes its asset recompute)")
    stat.set_defaults(fn=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    pass

    from jobs.home import lock_holder

    home = open_home(args)
    from dagster import DagsterInstance

    from jobs.definitions import ALL_ASSETS, complete_resource_config, make_definitions, make_resources
    from jobs.status import StatusReader, format_status, status_json

    from jobs.preflight import preflight

    defs = make_definitions(home)
    preset = load_preset(args.preset, keep_opt_in=True)
    refused = preflight(preset, home)  # what kiln run would refuse, refused here in the same words
    opt_in = preset.pop("opt_in", None) or []  # as kiln run reads it: the opt-in assets this preset runs
    if refused:
        print(f"kiln: fix preset {args.preset} first: {refused}", file=sys.stderr)
        return 2
    resources = make_resources(home)
    config = complete_resource_config(preset, resources)
    mlflow = preset_mlflow(config, resources)
    running = lock_holder(home)
    if running:  # what that run has not finished shows as still to run
        print(f"kiln status: {running} is running in {home} now", file=sys.stderr)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet), DagsterInstance.get() as instance:
        names = [a.key.to_user_string() for a in ALL_ASSETS]
        runs = run_selection(names, opt_in)
        rows = StatusReader(defs, instance, config, mlflow, verify=args.verify).status(
            names, skipped=[n for n in names if n not in runs])
    if args.json:
        print(status_json(rows))
    else:
        print(f"kiln status: the next `kiln run --preset {args.preset}` in {home}")
        print(format_status(rows), end="")
    return 0
