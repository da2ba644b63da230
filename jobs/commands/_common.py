"""What several commands share: the options they name alike, the home they open, the model they load."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from jobs.presets import PROJECT

HOME = str(PROJECT / ".kiln")
REGISTRY = f"sqlite:///{PROJECT / '.kiln' / 'mlflow.db'}"
MODEL = "release bundle folder, checkpoint (or run folder), GGUF file, or models:/NAME@ALIAS"
VERBOSE = "print every Dagster event and library warning on the terminal as well as in the log file"


def add_preset(p: Any, default: str = "demo", help: str = "name under conf/presets or a YAML path") -> None:  # noqa: A002
    p.add_argument("--preset", default=default, help=help)


def add_home(p: Any, help: str = "folder for storage, MLflow and Dagster history") -> None:  # noqa: A002
    p.add_argument("--home", default=HOME, help=help)


def add_verbose(p: Any, help: str = VERBOSE) -> None:  # noqa: A002
    p.add_argument("--verbose", action="store_true", help=help)


def add_model(p: Any, help: str = MODEL) -> None:  # noqa: A002
    """The model argument and the registry its models:/ references are looked up in."""
    p.add_argument("model", help=help)
    p.add_argument("--tracking-uri", default=REGISTRY, help="MLflow registry for models:/ references")


def add_sampling(p: Any, max_new_tokens: int, tokens_help: str, temperature: float, temperature_help: str,
                 top_k_help: str = "sample among the k most likely tokens", seed_help: str = "sampling seed") -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help=tokens_help)
    p.add_argument("--temperature", type=float, default=temperature, help=temperature_help)
    p.add_argument("--top-k", type=int, default=50, help=top_k_help)
    p.add_argument("--seed", type=int, default=0, help=seed_help)


def home_of(args: Any) -> Path:
    """The command's home, resolved, with Dagster's instance in it."""
    home = Path(args.home).resolve()
    os.environ.setdefault("DAGSTER_HOME", str(home / "dagster"))
    return home


def open_home(args: Any) -> Path:
    """``home_of``, checked writable (the command opens its databases), MLflow's own lines quietened."""
    from jobs.home import writable_home

    home = home_of(args)
    writable_home(home)
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    return home


def model_path(ref: str, tracking_uri: str) -> tuple[Path, Any]:
    """(folder, registered version or None) of ``ref`` (kiln.release.load.resolve_reference); a bad reference ends the
    command with its one line."""
    from kiln.release.load import resolve_reference

    try:
        return resolve_reference(ref, tracking_uri)
    except ValueError as e:
        raise SystemExit(f"kiln: {e}") from e


def loaded_model(args: Any, template_file: str = "") -> tuple[Path, Any, Any, str]:
    """(folder, model, tokenizer, chat template) of ``args.model``; one that cannot be loaded (a damaged bundle, a
    missing checkpoint, a corrupt tokenizer) ends the command with its one line."""
    from kiln.release.load import load_chat_model

    path, _ = model_path(args.model, args.tracking_uri)
    try:
        return (path, *load_chat_model(path, template_file))
    except (OSError, ValueError, RuntimeError) as e:
        raise SystemExit(f"kiln: cannot load {path}: {e}") from e
