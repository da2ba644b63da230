"""What ``kiln run`` checks before the first asset runs, and ``kiln status`` before it predicts: one decision, so that
the dry run never passes a preset the run refuses. ``preflight(preset, home, selection)`` returns the one line
saying what is wrong (None: the run may start): the preset's ``opt_in``, every op and resource name, the run config
as Dagster types it, the files the selected assets will read (a source manifest, the red-team probes, the judge's
principles: parsed as the asset parses them), every number of every selected step and resource (inside the
Domain its field declares, kiln.common.config.Domain) and the device the plan asks for.

Add a check for an asset that reads a file: one function in FILE_CHECKS (the asset's config dict and the run's ops ->
raise with the reason).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from kiln.common.config import ConfigError


def _manifest(config: dict[str, Any], ops: dict[str, Any]) -> None:
    from assets.collect import RawDocumentsConfig, project_path
    from kiln.sources.manifest import load_manifest

    manifest = RawDocumentsConfig(**config).manifest  # the asset's own default where the preset gives none
    if manifest:
        load_manifest(project_path(manifest))


def _probes(config: dict[str, Any], ops: dict[str, Any]) -> None:
    from assets.collect import project_path
    from assets.redteam import RedTeamReportConfig
    from kiln.evaluation.redteam import read_probes

    read_probes(project_path(RedTeamReportConfig(**config).probes))


def _principles(config: dict[str, Any], ops: dict[str, Any]) -> None:
    from assets.collect import project_path
    from assets.feedback import JudgedPreferencesConfig
    from kiln.posttrain.judge import read_principles

    read_principles(project_path(JudgedPreferencesConfig(**config).principles))


def _training_plan(config: dict[str, Any], ops: dict[str, Any]) -> None:
    """The device the plan asks for is on this machine (its numbers were checked with every other's: check_numbers),
    and the planner finds a plan for the hardware (the layout against the processes and nodes, the model against
    memory): what the asset plans, as ``kiln plan`` does, with the tokenizer config's vocabulary. Left to the asset
    when the plan depends on what runs first: an imported model's architecture, a sweep's best point, the
    ladder's law."""
    _device(config)
    pretrained = (ops.get("pretrained_model") or {}).get("config") or {}
    if pretrained.get("path") or pretrained.get("package") or config.get("from_sweep") or \
            config.get("sizing", "preset") != "preset":
        return
    from assets.training import TrainingPlanConfig
    from jobs.presets import preset_n_vocab

    TrainingPlanConfig(**config).planned(preset_n_vocab((ops.get("tokenizer") or {}).get("config") or {}))


def _device(config: dict[str, Any]) -> None:
    device = ((config.get("hardware") or {}).get("device")) or "cpu"
    if device not in ("cpu", "cuda", "auto"):
        raise ValueError(f"training_plan.hardware.device is {device!r}: give cpu, cuda or auto")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("training_plan.hardware.device is cuda, but this machine has no CUDA device "
                             "(torch.cuda.is_available() is False): run it on a GPU machine, or use a CPU preset "
                             "(demo, smoke) or device auto")


# asset -> the check of what its config (and the run's other ops' configs) make it read or need before it runs
FILE_CHECKS: dict[str, Callable[[dict[str, Any], dict[str, Any]], None]] = {
    "raw_documents": _manifest,
    "red_team_report": _probes,
    "judged_preferences": _principles,
    "training_plan": _training_plan,
}


def asset_configs() -> dict[str, type]:
    """{asset: its Config class}, read from each asset function's ``config`` parameter (the pipeline's, the sweep's
    and the ablation's)."""
    import typing

    from jobs.definitions import ALL_ASSETS, SWEEP_ASSETS

    out = {}
    for a in ALL_ASSETS + SWEEP_ASSETS:
        hint = typing.get_type_hints(a.op.compute_fn.decorated_fn).get("config")
        if hint is not None:
            out[a.key.to_user_string()] = hint
    return out


def check_numbers(run_config: dict[str, Any], home: Path, keys: list[str]) -> None:
    """ConfigError naming ``<asset>.<path>`` (or ``resources.<name>.<field>``) for the first number of the run config
    outside the Domain its field declares (kiln.common.config.Domain): the check each step makes when it starts,
    made for every selected step and resource before the first runs."""
    from assets._config import check_config_values
    from jobs.definitions import make_resources

    ops = run_config.get("ops") or {}
    for asset, cls in asset_configs().items():
        if asset in keys:
            check_config_values(cls, (ops.get(asset) or {}).get("config"), asset)
    bound = make_resources(home)
    for name, block in (run_config.get("resources") or {}).items():
        if name in bound:
            check_config_values(type(bound[name]), (block or {}).get("config"), f"resources.{name}")


def preflight(preset: dict[str, Any], home: Path, selection: list[str] | None = None) -> str | None:
    """The first reason a ``kiln run`` of ``preset`` (loaded with its opt_in) over ``selection`` (default: the assets
    it runs) would be refused before any asset runs, as one line; None when it may start. ``kiln status`` prints the
    same line and predicts nothing else."""
    from jobs.presets import preset_error, run_selection
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
    try:
        check_numbers(run_config, home, keys)
    except ConfigError as e:
        return str(e)
    for asset, check in FILE_CHECKS.items():
        if asset not in keys:
            continue
        try:
            check(dict((ops.get(asset) or {}).get("config") or {}), ops)
        except Exception as e:  # each loader's own error names the file and the key; keep its first line
            text = " ".join(str(e).split())
            return text if text.startswith(asset) or text.startswith("training_plan") else f"{asset}: {text}"
    return None
