"""``kiln verify``: a scrub of a Kiln home. Every output a finished run recorded is hashed, file by file, against the
witness recorded with it (``kiln run`` hashes a file before reusing it only when its size or time changed, so a byte
flipped in place with both kept, by bit rot, a bad disk or a stray write, is found here, or by
``kiln status --verify``). A damaged file is named and set aside (``.<name>.damaged`` beside it), so the next
``kiln run`` recomputes that output instead of reusing it; outputs are content-addressed, so the rebuilt file is the
one recorded. Exit status 1 when anything was damaged, for a schedule to alert on.

Run: ``kiln verify [--home H] [--preset P] [--json]`` (the preset names the MLflow server and storage, if not the
home's own).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable


def verify_home(mlflow, storage_root: str | None, set_aside: bool = True,
                say: Callable[[str], None] = print) -> dict[str, Any]:
    """Hash every recorded output of the home's experiment (each distinct witness once); {outputs, files, bytes,
    seconds, damaged: [{asset, run_id, problem}]}. ``say`` is told each damaged output as it is found."""
    from resources.tracking import output_problem, relocated

    t0 = time.perf_counter()
    client = mlflow.client()
    exp = client.get_experiment_by_name(mlflow.experiment)
    out: dict[str, Any] = {"outputs": 0, "files": 0, "bytes": 0, "damaged": []}
    if exp is None:
        return {**out, "seconds": 0.0}
    runs = client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED' and tags.`kiln.output_recorded` = "
                              "'true'", order_by=["attributes.start_time DESC"], max_results=50000)
    seen: set[str] = set()  # runs of one asset often record the same files: each witness is hashed once
    for r in runs:
        recorded = mlflow.read_record(client, r)
        if recorded is None:
            continue
        recorded, moved_from = relocated(recorded, storage_root)
        if moved_from is not None and not all(Path(p).exists() for p in (recorded.get("witnesses") or {})):
            continue  # another home's record whose files were never copied here: not this home's to judge
        key = json.dumps(recorded.get("witnesses"), sort_keys=True) + json.dumps(recorded.get("value"), default=str,
                                                                                   sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        out["outputs"] += 1
        for w in (recorded.get("witnesses") or {}).values():
            out["files"] += len(w["files"])
            out["bytes"] += sum(f[0] for f in w["files"].values())
        problem = output_problem(recorded, set_aside_damaged=set_aside, full=True)
        if problem is not None:
            asset = r.data.tags.get("dagster.asset_key", "?")
            out["damaged"].append({"asset": asset, "run_id": r.info.run_id, "problem": problem})
            say(f"kiln verify: damaged: {asset} (MLflow run {r.info.run_id}): {problem}; the next kiln run "
                f"recomputes it")
    return {**out, "seconds": round(time.perf_counter() - t0, 2)}


def summary_line(result: dict[str, Any]) -> str:
    gb = result["bytes"] / 1e9
    size = f"{gb:.2f} GB" if gb >= 0.1 else f"{result['bytes'] / 1e6:.1f} MB"
    verdict = (f"{len(result['damaged'])} damaged (set aside; the next kiln run recomputes them)"
               if result["damaged"] else "all intact")
    return (f"kiln verify: {result['outputs']} recorded outputs, {result['files']:,} files, {size} hashed in "
            f"{result['seconds']:.1f}s: {verdict}")
