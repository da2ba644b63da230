"""``kiln logbook``: every attempt of a training run or of each stage of a release, and how each ended."""

from __future__ import annotations

import argparse
from typing import Any




def add_parser(sub: Any) -> None:
    lb = sub.add_parser("logbook", help="every attempt of a training run or of each stage of a release: how each ended")
    lb.add_argument("run", help="run folder (.kiln/storage/base_model/<key>), checkpoint, or release bundle folder")
    lb.add_argument("--json", action="store_true", help="every attempt's row as JSON")
    lb.set_defaults(fn=cmd_logbook)


def cmd_logbook(args: argparse.Namespace) -> int:
    from kiln.train.logbook import main as logbook_main

    return logbook_main([args.run] + (["--json"] if args.json else []))
