"""``kiln sweep``: a preset's hyper-parameter sweep (jobs.sweeps.run_sweep), then the ranked points."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


from jobs.commands._common import add_home, add_preset, add_verbose, home_of
from jobs.console import format_seconds
from jobs.presets import load_preset
from jobs.commands.run import report_failure, run_output


def add_parser(sub: Any) -> None:
    sw = sub.add_parser("sweep", help="run a preset's hyper-parameter sweep: the grid, every point (reused when it ran), the ranking")
    add_preset(sw, "sweep-demo", "name under conf/presets or a YAML path (its sweep_grid block)")
    add_home(sw)
    add_verbose(sw)
    sw.set_defaults(fn=cmd_sweep)


def run_points(args: argparse.Namespace, kind) -> dict[str, Any] | int:
    """jobs.sweeps.run_sweep of ``kind`` in the home with the preset's blocks: its results asset's value, or the exit
    code when the preset has no grid block (2) or a step failed (1; 2 for a refused config)."""
    from dagster import DagsterInstance

    from jobs.console import RunConsole
    from jobs.definitions import make_definitions
    from jobs.home import home_lock, writable_home
    from jobs.sweeps import SweepFailed, run_sweep

    verb = kind.verb
    home = home_of(args)
    preset = load_preset(args.preset, sweep=True)
    if not (preset.get("ops") or {}).get(kind.grid):
        print(f"kiln: preset {args.preset} has no {kind.grid} block: say which fields to vary (see "
              f"conf/presets/{kind.example}.yaml)", file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    console = RunConsole(home / "logs" / f"{verb}-{stamp}-events.log", [*kind.data, kind.grid, kind.point, kind.results],
                         verbose=args.verbose)
    print(f"kiln {verb}: preset {args.preset}; full log: {console.log_path}", flush=True)
    with home_lock(writable_home(home), f"{verb} {args.preset}"):
        try:
            with console, run_output(console), DagsterInstance.get() as instance:
                return run_sweep(make_definitions(home), instance, preset.get("ops") or {}, console.say,
                                 tags={"kiln/preset": args.preset}, console=console, kind=kind)
        except SweepFailed as e:
            if e.result is not None:
                report_failure(e.result, home, args.verbose)
            print(f"kiln {verb}: {e}", file=sys.stderr)
            return 1 if e.result is not None else 2


def cmd_sweep(args: argparse.Namespace) -> int:
    """``kiln sweep``: jobs.sweeps.run_sweep in the home, then the ranked points."""
    from jobs.sweeps import SWEEP

    start = time.time()
    results = run_points(args, SWEEP)
    if isinstance(results, int):
        return results
    print(f"kiln sweep: {len(results['rows'])} points in {format_seconds(time.time() - start)}; best {results['best']['key']} "
          f"(final val loss {results['best']['final_val_loss']:.4f})")
    for r in results["rows"]:
        print(f"  {r['rank'] or '-':>3}  {r['key']:<40} {r['final_val_loss']:.4f}")
    print("Train the best point with training_plan.from_sweep: true (sweep-demo sets it): kiln run --preset sweep-demo")
    return 0
