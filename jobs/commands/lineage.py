"""``kiln lineage``: which data, configs and runs made a release or checkpoint."""

from __future__ import annotations

import argparse
import json
from typing import Any

from jobs.commands._common import add_model, model_path



def add_parser(sub: Any) -> None:
    lin = sub.add_parser("lineage", help="which data, configs and runs made a release or checkpoint")
    add_model(lin, "release bundle folder, checkpoint (or run folder), or models:/NAME@ALIAS")
    lin.add_argument("--json", action="store_true", help="print kiln.json (or the checkpoint's record) as JSON")
    lin.add_argument("--full", action="store_true", help="show every list item (the tree shows 12 per section)")
    lin.set_defaults(fn=cmd_lineage)


def cmd_lineage(args: argparse.Namespace) -> int:
    from kiln.release.bundle import is_release
    from kiln.release.lineage import checkpoint_lineage, lineage_tree, read_release_info

    p, registered = model_path(args.model, args.tracking_uri)
    try:
        info = read_release_info(p) if is_release(p) else checkpoint_lineage(p)
    except (OSError, ValueError, RuntimeError) as e:  # damaged bundle, missing checkpoint, corrupt tokenizer
        raise SystemExit(f"kiln: lineage of {p}: {e}") from e
    if registered is not None:
        info["registry"] = {"name": registered.name, "version": registered.version, "aliases": registered.aliases,
                            "source": registered.source, "run_id": registered.run_id, "previous": registered.previous}
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True, default=str))
    else:
        print(lineage_tree(info, full=args.full), end="")
    return 0
