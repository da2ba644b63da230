"""``kiln config``: a preset's full run config, ``extends`` resolved."""

from __future__ import annotations

import argparse
from typing import Any

import yaml

from jobs.presets import load_preset


def add_parser(sub: Any) -> None:
    conf = sub.add_parser("config", help="print a preset's full run config (extends resolved)")
    conf.add_argument("--preset", default="demo", help="name under conf/presets or a YAML path")
    conf.set_defaults(fn=cmd_config)


def cmd_config(args: argparse.Namespace) -> int:
    print(yaml.safe_dump(load_preset(args.preset, sweep=True), sort_keys=False), end="")
    return 0
