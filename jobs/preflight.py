"""What ``kiln run`` checks before the first asset runs, and ``kiln status`` before it predicts: one decision, so that
the dry run never passes a preset the run refuses. ``preflight(preset, home, selection)`` returns the one line
saying what is wrong (None: the run may start): the preset's ``opt_in``, every op and resource name, the run config
as Dagster types it, the files the selected assets will read (a source manifest, the red-team probes, the judge's
principles: parsed as the asset parses them), the training plan's numbers (each inside its declared domain,
kiln.common.config.Domain) and the device it asks for.

Add a check for an asset that reads a file: one function in FILE_CHECKS (the asset's config dict -> raise with the
reason).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

def _manifest(config: dict[str, Any]) -> None:
    from assets.collect import RawDocumentsConfig, project_path
    from kiln.sources.manifest import load_manifest

    manifest = RawDocumentsConfig(**config).manifest  # the asset's own default where the preset gives none
    if manifest:
        load_manifest(project_path(manifest))


def _probes(config: dict[str, Any]) -> None:
    from assets.collect import project_path
    from assets.redteam import RedTeamReportConfig
    from kiln.evaluation.redteam import read_probes

    read_probes(project_path(RedTeamReportConfig(**config).probes))


def _principles(config: dict[str, Any]) -> None:
    from assets.collect import project_path
    from assets.feedback import JudgedPreferencesConfig
    from kiln.posttrain.judge import read_principles

    read_principles(project_path(JudgedPreferencesConfig(**config).principles))


def _training_plan(config: dict[str, Any]) -> None:
    """The hardware, batch and parallel blocks parsed as the plan parses them (each number inside its domain: no
    process count of 0 reaches the arithmetic), then the device."""
    from kiln.common.config import from_dict
    from kiln.plan import BatchConfig, HardwareConfig, ParallelConfig

    for key, cls in (("hardware", HardwareConfig), ("batch", BatchConfig), ("parallel", ParallelConfig)):
        from_dict(cls, config.get(key) or {}, f"training_plan.{key}")
    device = ((config.get("hardware") or {}).get("device")) or "cpu"
    if device not in ("cpu", "cuda", "auto"):
        raise ValueError(f"training_plan.hardware.device is {device!r}: give cpu, cuda or auto")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("training_plan.hardware.device is cuda, but this machine has no CUDA device "
                             "(torch.cuda.is_available() is False): run it on a GPU machine, or use a CPU preset "
                             "(demo, smoke) or device auto")


# asset -> the check of what its config makes it read or need before it runs
FILE_CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "raw_documents": _manifest,
    "red_team_report": _probes,
    "judged_preferences": _principles,
    "training_plan": _training_plan,
}


def preflight(preset: dict[str, Any], home: Path, selection: list[str] | None = None) -> str | None:
    """The first reason a ``kiln run`` of ``preset`` (loaded with its opt_in) over ``selection`` (default: the assets
    it runs) would be refused before any asset runs, as one line; None when it may start. ``kiln status`` prints the
    same line and predicts nothing else."""
    from jobs.cli import preset_error, run_selection
    from jobs.definitions import ALL_ASSETS, OPT_IN

    opt_in = preset.get("opt_in") or []
    if set(opt_in) - set(OPT_IN):
        return f"opt_in may name {', '.join(OPT_IN)}: unknown {sorted(set(opt_in) - set(OPT_IN))}"
    keys = selection if selection is not None else run_selection([a.key.to_user_string() for a in ALL_ASSETS], opt_in)
    run_config = {k: v for k, v in preset.items() if k != "opt_in"}
    refused = preset_error(run_config, home, keys)  # names, keys and types, as Dagster checks them
    if refused:
        return refused
    ops = run_config.get("ops") or {}
    for asset, check in FILE_CHECKS.items():
        if asset not in keys:
            continue
        try:
            check(dict((ops.get(asset) or {}).get("config") or {}))
        except Exception as e:  # each loader's own error names the file and the key; keep its first line
            text = " ".join(str(e).split())
            return text if text.startswith(asset) or text.startswith("training_plan") else f"{asset}: {text}"
    return None
