"""``kiln lineage``: which data, configs and runs made a release or checkpoint."""

from __future__ import annotations

import argparse
import json
from typing import Any


from jobs.presets import PROJECT
from jobs.commands._model import model_path


def add_parser(sub: Any) -> None:
    lin = sub.add_parser("lineage", help="which data, configs and runs made a release or checkpoint")
    lin.add_argument("model", help="release bundle folder, checkpoint (or run folder), or models:/NAME@ALIAS")
    lin.add_argument("--json", action="store_true", help="print kiln.json (or the checkpoint's record) as JSON")
    lin.add_argument("--full", action="store_true", help="show every list item (the tree shows 12 per section)")
    lin.add_argument("--tracking-uri", default=f"sqlite:///{PROJECT / '.kiln' / 'mlflow.db'}", help="MLflow registry for models:/ references")
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
