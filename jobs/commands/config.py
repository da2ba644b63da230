"""``kiln config``: a preset's full run config, ``extends`` resolved."""

from __future__ import annotations

import argparse
from typing import Any

import yaml

from jobs.commands._common import add_preset
from jobs.presets import load_preset


def add_parser(sub: Any) -> None:
    conf = sub.add_parser("config", help="print a preset's full run config (extends resolved)")
    add_preset(conf)
    conf.set_defaults(fn=cmd_config)


def cmd_config(args: argparse.Namespace) -> int:
    print(yaml.safe_dump(load_preset(args.preset, sweep=True), sort_keys=False), end="")
    return 0
