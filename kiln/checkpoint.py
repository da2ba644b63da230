"""Training checkpoints: written atomically with a checksum, verified and loaded without unpickling code.

A checkpoint is a folder ``step_NNNNNNN/`` holding ``state.pt`` and ``meta.json`` (sha256, step, config).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from kiln.storage import _fsync_dir, atomic_write_json, sha256_file, staging_dir

STEP_DIR = re.compile(r"^step_(\d{7,})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated or fails its checksum; the message names the file."""


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(ckpt_root: Path, step: int, state: dict[str, Any], meta: dict[str, Any],
                    extra_files: dict[str, Path] | None = None, keep_last: int = 3) -> Path:
    """Write ``state`` (a dict of tensors and plain values) as checkpoint ``step``.

    The folder is written under a temporary name, fsynced, then renamed: a crash mid-save leaves the
    previous checkpoint intact. ``extra_files`` (for example the tokenizer) are copied in beside it.
    """
    ckpt_root = Path(ckpt_root)
    final = ckpt_root / f"step_{step:07d}"
    with staging_dir(ckpt_root, f"step_{step:07d}") as tmp:
        state_path = tmp / "state.pt"
        with open(state_path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        files = {"state.pt": sha256_file(state_path)}
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, tmp / name)
            files[name] = sha256_file(tmp / name)
        atomic_write_json(tmp / "meta.json", {**meta, "step": step, "files": files})
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(ckpt_root)
    prune_checkpoints(ckpt_root, keep_last)
    return final


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Checkpoint folders under ``ckpt_root`` that have a meta.json, oldest first."""
    ckpt_root = Path(ckpt_root)
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.iterdir() if STEP_DIR.match(p.name) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))  # type: ignore[union-attr]


def prune_checkpoints(ckpt_root: Path, keep_last: int) -> None:
    for old in list_checkpoints(ckpt_root)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check every file against meta.json; return the meta or raise CheckpointError naming the file."""
    path = Path(path)
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(f"{path}: no meta.json; this is not a complete Kiln checkpoint")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_path}: unreadable ({e}); delete the folder to fall back to an older checkpoint") from e
    for name, digest in meta.get("files", {}).items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing from checkpoint")
        actual = sha256_file(f)
        if actual != digest:
            raise CheckpointError(
                f"{f}: checksum mismatch (expected {digest[:16]}…, found {actual[:16]}…): the file is truncated or "
                "damaged; use an earlier checkpoint"
            )
    return meta


def load_state(path: Path, map_location: str | torch.device = "cpu") -> tuple[dict[str, Any], dict[str, Any]]:
    """Verify and load a checkpoint's state with ``weights_only=True`` (no arbitrary unpickling)."""
    meta = verify_checkpoint(path)
    state = torch.load(Path(path) / "state.pt", map_location=map_location, weights_only=True)
    return state, meta


def latest_good_checkpoint(ckpt_root: Path, log=print) -> Path | None:
    """Newest checkpoint that passes its checksum; damaged newer ones are reported and skipped."""
    for path in reversed(list_checkpoints(ckpt_root)):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as e:
            log(f"skipping damaged checkpoint: {e}")
    return None


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint folder, a checkpoints root, or a training output folder; return a checkpoint."""
    path = Path(path)
    if (path / "meta.json").is_file() and (path / "state.pt").is_file():
        return path
    for root in (path, path / "checkpoints"):
        found = latest_good_checkpoint(root)
        if found is not None:
            return found
    raise CheckpointError(
        f"{path}: no checkpoint found (expected a step_NNNNNNN folder with meta.json and state.pt); "
        "materialize the training asset first or pass a checkpoint folder"
    )


def load_for_inference(path: str | Path, map_location: str = "cpu"):
    """(model in eval mode, its tokenizer, meta) from a checkpoint, a checkpoints root or a run folder."""
    from kiln.model import GPT, GPTConfig
    from kiln.tokenizer import load_encoding

    ckpt = resolve_checkpoint(path)
    state, meta = load_state(ckpt, map_location)
    model = GPT(GPTConfig(**meta["model"]))
    model.load_state_dict(state["model"])
    model.eval()
    enc = load_encoding(ckpt / "tokenizer.json")
    return model, enc, {**meta, "path": str(ckpt)}
