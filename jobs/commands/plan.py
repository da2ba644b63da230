"""``kiln plan``: the training plan a preset gets (kiln.plan.planner), without running anything."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable


from jobs.commands._common import add_preset
from jobs.presets import PROJECT, load_preset, preset_error, preset_n_vocab, preset_pretrained


def add_parser(sub: Any) -> None:
    pl = sub.add_parser("plan", help="the training plan a preset gets (parallelism, batch, memory, hours) without running")
    add_preset(pl)
    pl.add_argument("--vocab", type=int, default=0, help="tokenizer size to plan for (default: from the preset's tokenizer config)")
    pl.add_argument("--json", action="store_true", help="the whole plan as JSON")
    pl.set_defaults(fn=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from assets.training import TrainingPlanConfig
    from kiln.pretrained.config import PretrainedError

    from jobs.preflight import check_numbers
    from kiln.common.config import ConfigError

    preset = load_preset(args.preset)
    refused = preset_error(preset, PROJECT / ".kiln")  # the resources are objects only: nothing there is touched
    if refused is None:  # each number inside its field's domain, as kiln run checks it before the first asset
        try:
            check_numbers(preset, PROJECT / ".kiln", ["pretrained_model", "tokenizer", "training_plan"])
        except ConfigError as e:
            refused = str(e)
    if refused:  # the preset as `kiln run` types it: a string for an integer is refused here as there
        print(f"kiln: preset {args.preset}: {refused}", file=sys.stderr)
        return 2
    ops = preset.get("ops") or {}
    conf = dict((ops.get("training_plan") or {}).get("config") or {})
    try:  # the architecture of an imported model, as the training_plan asset gets it from pretrained_model
        pretrained, shown = preset_pretrained(ops, args.preset)
    except PretrainedError as e:
        print(f"kiln: preset {args.preset}: {e}" if str(e).startswith("pretrained_model") else f"kiln: preset {args.preset}: pretrained_model.path: {e}", file=sys.stderr)
        return 2
    if pretrained and args.vocab:
        print(f"kiln: --vocab: the vocabulary comes from pretrained_model.path ({pretrained['path']})", file=sys.stderr)
        return 2
    n_vocab = shown.get("n_vocab") or args.vocab or preset_n_vocab((ops.get("tokenizer") or {}).get("config") or {})
    # the same fields as the asset gets: typed as Dagster types them, then kiln.plan.planner.plan_training
    planned = plan_or_refuse(args.preset, lambda: TrainingPlanConfig(**conf).planned(n_vocab, pretrained))
    if planned is None:
        return 2
    if args.json:
        shown_plan = planned.layout.to_dict() if planned.layout is not None else planned.single.to_dict()
        print(json.dumps({**shown_plan, **({"pretrained": shown} if shown else {})}, indent=2))
        return 0
    if shown:
        added = ", ".join(f"{t}={i}" for t, i in shown["added_tokens"].items()) or "none"
        print(f"pretrained   {shown['source']} ({shown['family']}: config.json and tokenizer.json; "
              f"{shown['imported_vocab']:,} imported tokens, added {added})")
    # the plan, or the layout's choice size by size; a single-node plan's device-hours, energy, money and the
    # compute-optimal size
    print(planned.describe(), end="")
    return 0


def plan_or_refuse(preset: str, make: Callable[[], Any]) -> Any:
    """What ``make()`` plans, or None after one line on stderr saying what the preset asks that cannot be (a value
    of the wrong kind, a model that fits nowhere)."""
    from pydantic import ValidationError

    from kiln.common.config import ConfigError
    from kiln.plan.memory import PlanError

    try:
        return make()
    except ValidationError as e:
        bad = e.errors()[0]
        print(f"kiln: preset {preset}: training_plan.{'.'.join(map(str, bad['loc']))}: {bad['msg']}", file=sys.stderr)
    except (PlanError, ConfigError) as e:
        print(f"kiln: preset {preset}: {e}", file=sys.stderr)
    return None
