"""config.json of a Hugging Face causal LM -> Kiln's ModelConfig, for the architectures Kiln's model files reproduce.

``model_config(folder)``; each family reads its own model_types (kiln.model.families.StateDictAdapter.readers, with
``require`` and ``rope_theta`` from here); a model_type no family reads is refused with what is supported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from kiln.model.config import ModelConfig


class PretrainedError(ValueError):
    """A Hugging Face folder cannot be imported exactly; the message names the file and what to do."""


def read_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise PretrainedError(f"{path}: missing; a Hugging Face model folder needs config.json beside its safetensors "
                              "(save one with model.save_pretrained(folder))")
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PretrainedError(f"{path}: not readable JSON ({e}); re-download or re-save the model") from e
    if not isinstance(doc, dict):
        raise PretrainedError(f"{path}: expected a JSON object")
    return doc


def require(path: Path, doc: dict, key: str, allowed: Callable[[Any], bool], what: str) -> None:
    """PretrainedError when config.json sets ``key`` to a value Kiln's model would compute differently."""
    if key in doc and doc[key] is not None and not allowed(doc[key]):
        raise PretrainedError(f"{path}: {key}={doc[key]!r} is not supported ({what}); Kiln's model would compute "
                              "different outputs, so it is not imported")


def rope_theta(path: Path, doc: dict) -> float:
    """rope_theta from transformers 5's ``rope_parameters`` or the older top-level key; scaled RoPE is refused."""
    rope = doc.get("rope_parameters") or doc.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind != "default":
        raise PretrainedError(f"{path}: rope type {kind!r} is not supported (Kiln's Llama has plain RoPE); "
                              "import a model without rope scaling")
    return float(rope.get("rope_theta") or doc.get("rope_theta") or 10000.0)


def model_config_of(path: Path, doc: dict[str, Any]) -> ModelConfig:
    """Kiln's ModelConfig of a config.json's fields ``doc`` (read from ``path``, which errors name); unsupported
    architectures are refused with what is supported."""
    from kiln.model.families import hf_readers

    kind = doc.get("model_type")
    readers = hf_readers()  # each family's own (kiln.model.families.StateDictAdapter.readers)
    if kind not in readers:
        raise PretrainedError(f"{path}: model_type {kind!r} is not supported; Kiln imports {', '.join(readers)} "
                              "(the decoders its model families compute exactly)")
    try:
        return readers[kind][1](path, doc)
    except KeyError as e:
        raise PretrainedError(f"{path}: key {e.args[0]!r} missing for model_type {kind!r}; the file is incomplete") from e
    except ValueError as e:
        if isinstance(e, PretrainedError):
            raise
        raise PretrainedError(f"{path}: {e}") from e


def model_config(folder: Path) -> tuple[ModelConfig, dict[str, Any]]:
    """(Kiln's ModelConfig, the raw config.json) of a Hugging Face folder; unsupported architectures are refused."""
    doc = read_config(folder)
    return model_config_of(Path(folder) / "config.json", doc), doc
