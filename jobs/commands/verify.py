"""``kiln verify``: hash every output a home recorded against its witness (jobs.verify)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


from jobs.commands._common import add_home, add_preset, open_home
from jobs.presets import load_preset, preset_mlflow


def add_parser(sub: Any) -> None:
    ver = sub.add_parser("verify", help="hash every output a home recorded; set aside the damaged, which runs recompute")
    add_home(ver, "the Kiln home to scrub")
    add_preset(ver, help="name under conf/presets or a YAML path (its MLflow and storage resources are read)")
    ver.add_argument("--json", action="store_true", help="the counts and each damaged output as JSON")
    ver.set_defaults(fn=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    """``kiln verify``: hash every recorded output of the home against its witness (jobs.verify)."""

    from jobs.definitions import complete_resource_config, make_resources
    from jobs.verify import summary_line, verify_home

    home = open_home(args)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per record read is not output
    resources = make_resources(home)
    config = complete_resource_config(load_preset(args.preset), resources)
    root = (((config.get("resources") or {}).get("storage") or {}).get("config") or {}).get("root")
    result = verify_home(preset_mlflow(config, resources), str(Path(root or resources["storage"].root).resolve()),
                         say=lambda line: print(line, file=sys.stderr))
    print(json.dumps(result, indent=2) if args.json else summary_line(result))
    return 1 if result["damaged"] else 0
