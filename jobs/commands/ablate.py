"""``kiln ablate``: a preset's data ablation (jobs.sweeps.run_sweep with ABLATION), then each point beside the baseline."""

from __future__ import annotations

import argparse
import time
from typing import Any


from jobs.commands._common import add_home, add_preset, add_verbose
from jobs.console import format_seconds
from jobs.commands.sweep import run_points


def add_parser(sub: Any) -> None:
    ab = sub.add_parser("ablate", help="run a preset's data ablation: every point's proxies (reused when they ran), the verdicts")
    add_preset(ab, "ablation-demo", "name under conf/presets or a YAML path (its ablation_grid block)")
    add_home(ab)
    add_verbose(ab)
    ab.set_defaults(fn=cmd_ablate)


def cmd_ablate(args: argparse.Namespace) -> int:
    """``kiln ablate``: a data ablation (jobs.sweeps.run_sweep with ABLATION), then each point beside the baseline."""
    from jobs.sweeps import ABLATION

    start = time.time()
    report = run_points(args, ABLATION)
    if isinstance(report, int):
        return report
    print(f"kiln ablate: {report['points']} points in {format_seconds(time.time() - start)} "
          f"({report['reused_points']} reused whole); bits per byte on the fixed evaluation set, point minus baseline, "
          "95% interval over seeds:")
    for r in report["rows"]:
        if "bpb" not in r:
            print(f"  {r['point']:<32} {r['verdict']}: {r.get('note', '')}")
            continue
        interval = f"[{r['low']:+.4f}, {r['high']:+.4f}]" if r.get("low") is not None else ""
        print(f"  {r['point']:<32} {r['kept_docs']:>6,} docs {r['train_tokens']:>10,} tokens  bpb {r['bpb']:.4f}  "
              f"{r['diff']:+.4f} {interval:<20} {r['verdict']}")
    mix = report.get("mixture")
    if mix:
        fit, ver = mix["fit"], mix["verification"]
        print(f"kiln ablate: mixture regression over {fit['n']} mixtures: leave-one-out MAE {fit['loo_mae']:.4f} bpb "
              f"(predicting the mean: {fit['loo_mae_mean']:.4f}); predicted best {mix['best']['shares']}; verified "
              f"against the default: {ver['diff']:+.4f} [{ver['low']:+.4f}, {ver['high']:+.4f}] {ver['verdict']}")
    return 0
