"""The model a command names: a folder or GGUF file, or a registry reference resolved through MLflow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.release.load import resolve_reference


def model_path(ref: str, tracking_uri: str) -> tuple[Path, Any]:
    """(folder, registered version or None) of ``ref`` (kiln.release.load.resolve_reference); a bad reference ends the
    command with its one line."""
    try:
        return resolve_reference(ref, tracking_uri)
    except ValueError as e:
        raise SystemExit(f"kiln: {e}") from e
