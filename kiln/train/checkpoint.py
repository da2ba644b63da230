"""Training checkpoints on disk: atomic folders with a checksum manifest, verified and loaded without unpickling code.

A checkpoint is a folder ``step_NNNNNNN/`` holding ``meta.json`` (step, config, a checksum per file) and either
``state.pt`` (the full state, written by rank 0) or ``state.pt`` plus ``model/`` (FSDP2 shards written by every
rank with torch.distributed.checkpoint). This module is the format: writing a folder (``save_checkpoint``, and the
pieces kiln.train.checkpointer's ``Checkpointer`` saves a training loop's state with), verifying it and loading it
(``load_state``, ``load_for_inference``) wherever checkpoints are read.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import xxhash

from kiln.common.files import DIGEST, DamagedFileError, _fsync_dir, atomic_write_json, file_digest, stable_hash, witness
from kiln.train.diskfull import naming

STEP_DIR = re.compile(r"^step_(\d{7,})$")
STAGING_PREFIX = ".step_"  # folders being written; a save killed part way leaves one, cleaned up on the next start
CHECKSUM = DIGEST  # xxh3_128: hashes at several GB/s (file_digest, "sha256" for older checkpoints)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated or fails its checksum; the message names the file."""


class DamagedCheckpointError(DamagedFileError, CheckpointError):
    """A checkpoint file that fails its checksum (a DamagedFileError naming it)."""


# ---------------------------------------------------------------------------------------------- writing


_SAVE_LOCK = threading.Lock()


def write_state_file(path: Path, obj: Any, on_write: Callable[[Path], None] | None = None) -> str:
    """torch.save ``obj`` to ``path``, fsync it, return its checksum.

    torch.save's per-record CRC32 is turned off for the write: it costs more than the write itself here, and
    the file's xxh3 checksum (checked on every load) covers every byte. torch.save writes through a Python file
    object: its failed writes raise OSError with their errno, where torch.save given a path turns a full disk into
    a RuntimeError without one; an ENOSPC names ``path`` (kiln.train.diskfull). ``on_write(path)`` is called once
    the file is on disk, before the checkpoint holding it is committed.
    """
    with naming(path):
        with _SAVE_LOCK:
            crc = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
            try:
                with open(path, "wb") as f:
                    torch.save(obj, f)
            finally:
                torch.serialization.set_crc32_options(crc)
        digest = _synced_digest(path)
    if on_write is not None:
        on_write(path)
    return digest


def _synced_digest(path: Path) -> str:
    """fsync ``path`` while computing its checksum (from the page cache, just written); raise what fsync raised."""
    fd = os.open(path, os.O_RDONLY)
    failed: list[OSError] = []

    def flush() -> None:
        try:
            os.fsync(fd)
        except OSError as e:
            failed.append(e)

    try:
        flusher = threading.Thread(target=flush)  # the disk flushes while the checksum is computed
        flusher.start()
        digest = file_digest(path)
        flusher.join()
    finally:
        os.close(fd)
    if failed:
        raise failed[0]
    return digest


# ---------------------------------------------------------------------------------------------- folders


def step_dir(ckpt_root: Path, step: int) -> Path:
    return Path(ckpt_root) / f"step_{step:07d}"


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Checkpoint folders under ``ckpt_root`` that have a meta.json, oldest first."""
    ckpt_root = Path(ckpt_root)
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.iterdir() if STEP_DIR.match(p.name) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))  # type: ignore[union-attr]


def step_of(path: Path) -> int:
    m = STEP_DIR.match(Path(path).name)
    if not m:
        raise CheckpointError(f"{path}: not a checkpoint folder (expected step_NNNNNNN)")
    return int(m.group(1))


def prune_checkpoints(ckpt_root: Path, keep_last: int, keep_every: int = 0) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints and those whose step is a multiple of ``keep_every``.

    ``keep_last=0`` keeps everything. Returns the folders removed.
    """
    if keep_last <= 0:
        return []
    removed = []
    for old in list_checkpoints(ckpt_root)[:-keep_last]:
        if keep_every > 0 and step_of(old) % keep_every == 0:
            continue
        shutil.rmtree(old, ignore_errors=True)
        removed.append(old)
    return removed


def clean_staging(ckpt_root: Path) -> list[Path]:
    """Remove folders left by saves that were killed part way (never a committed checkpoint)."""
    ckpt_root = Path(ckpt_root)
    if not ckpt_root.is_dir():
        return []
    stale = [p for p in ckpt_root.iterdir() if p.name.startswith(STAGING_PREFIX) and p.is_dir()]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def staging_dir(ckpt_root: Path, step: int) -> Path:
    """The folder a save of ``step`` writes into; a deterministic name so every rank of a sharded save agrees."""
    return Path(ckpt_root) / f"{STAGING_PREFIX}{step:07d}.partial"


def commit_checkpoint(tmp: Path, final: Path, files: dict[str, str], meta: dict[str, Any]) -> Path:
    """Write meta.json last, then rename the staging folder into place: the checkpoint appears whole or not at all."""
    with naming(tmp / "meta.json"):
        atomic_write_json(tmp / "meta.json", {**meta, "checksum": CHECKSUM, "files": files})
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    return final


def digest_tree(folder: Path, skip: set[str]) -> dict[str, str]:
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and rel not in skip and rel != "meta.json":
            out[rel] = file_digest(p)
    return out


def save_checkpoint(ckpt_root: Path, step: int, state: dict[str, Any], meta: dict[str, Any],
                    extra_files: dict[str, Path] | None = None, keep_last: int = 3, keep_every: int = 0) -> Path:
    """Write ``state`` (a dict of tensors and plain values) as checkpoint ``step``, synchronously.

    The folder is written under a temporary name, fsynced, then renamed: a crash mid-save leaves the previous
    checkpoint intact. ``extra_files`` (for example the tokenizer) are copied in beside it.
    """
    ckpt_root = Path(ckpt_root)
    tmp = staging_dir(ckpt_root, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        files = {"state.pt": write_state_file(tmp / "state.pt", state)}
        files.update(copy_extra_files(tmp, extra_files))
        final = commit_checkpoint(tmp, step_dir(ckpt_root, step), files, {**meta, "step": step, "format": "full"})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune_checkpoints(ckpt_root, keep_last, keep_every)
    return final


def copy_extra_files(folder: Path, extra_files: dict[str, Path] | None) -> dict[str, str]:
    out = {}
    for name, src in (extra_files or {}).items():
        with naming(folder / name):
            shutil.copyfile(src, folder / name)
        out[name] = file_digest(folder / name)
    return out


# ---------------------------------------------------------------------------------------------- verify and load


def weights_digest(model_state: dict[str, torch.Tensor]) -> str:
    """xxh3-128 of a model state dict's names, dtypes, shapes and bytes, in name order: equal exactly when the
    weights are bit-identical, whatever else (optimizer, timings, step bookkeeping) the checkpoint holds."""
    h = xxhash.xxh3_128()
    for name in sorted(model_state):
        t = model_state[name].detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def checkpoint_identity(path: Path) -> str:
    """A checkpoint's identity for data versions: the digest of its weights when recorded (full checkpoints),
    else the hash of its checksum manifest (sharded ones). No file is read beyond meta.json."""
    meta = json.loads((Path(path) / "meta.json").read_text())
    if meta.get("weights_digest"):
        return meta["weights_digest"][:16]
    return stable_hash(meta["files"])[:16]


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
    algo = meta.get("checksum", "sha256")
    if not meta.get("files"):
        raise CheckpointError(f"{meta_path}: lists no files; delete the folder to fall back to an older checkpoint")
    for name, digest in meta["files"].items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing from checkpoint")
        actual = file_digest(f, algo)
        if actual != digest:
            raise DamagedCheckpointError(
                f"{f}: checksum mismatch (expected {digest[:16]}…, found {actual[:16]}…): the file is truncated or "
                "damaged; use an earlier checkpoint", f)
    return meta


def checkpoint_witness(path: Path) -> dict[str, Any] | None:
    """The witness (kiln.common.files.witness) of checkpoint folder ``path``: each file's size and time with the
    checksum meta.json records for it, and meta.json itself; no file but meta.json is read. Marked ``checkpoint``:
    a damaged checkpoint is left where it is, for training to skip and write again. None when ``path`` is not a
    checkpoint folder."""
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
        return None
    return {**witness(path, meta["files"], meta.get("checksum", "sha256"), [*meta["files"], "meta.json"]),
            "checkpoint": True}


def load_state_file(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Tensors and plain values only (weights_only), memory-mapped: the pages verify_checkpoint just read are
    used in place rather than copied (copy-on-write, so the file is never changed)."""
    return torch.load(path, map_location=map_location, weights_only=True, mmap=True)


def load_state(path: Path, map_location: str | torch.device = "cpu") -> tuple[dict[str, Any], dict[str, Any]]:
    """Verify a checkpoint and load its state with ``weights_only=True``; a sharded one is assembled into one
    full ``state["model"]`` (optimizer shards are left on disk)."""
    path = Path(path)
    meta = verify_checkpoint(path)
    state = load_state_file(path / "state.pt", map_location)
    if meta.get("format") == "sharded":
        from kiln.model.config import ModelConfig
        from kiln.model.families import build_model

        with torch.device("meta"):
            template = build_model(ModelConfig(**meta["model"])).state_dict()
        model = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in template.items()}
        load_sharded({"model": model}, path / "model")
        state["model"] = model
    return state, meta


def latest_good_checkpoint(ckpt_root: Path, log=print, before_step: int | None = None) -> Path | None:
    """Newest checkpoint (at most ``before_step``) that passes its checksum; damaged ones are reported and skipped."""
    for path in reversed(list_checkpoints(ckpt_root)):
        if before_step is not None and step_of(path) > before_step:
            continue
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
    from kiln.model.config import ModelConfig
    from kiln.model.families import build_model
    from kiln.tokens.tokenizer import load_encoding

    ckpt = resolve_checkpoint(path)
    state, meta = load_state(ckpt, map_location)
    model = build_model(ModelConfig(**meta["model"]))
    model.load_state_dict(state["model"])
    model.eval()
    enc = load_encoding(ckpt / "tokenizer.json")
    return model, enc, {**meta, "path": str(ckpt)}


# ---------------------------------------------------------------------------------------------- safe DCP reading

# torch.distributed.checkpoint keeps its index in a pickle (``.metadata``) and unpickles non-tensor values with
# weights_only=False. These two subclasses allow only the classes that index is made of, and load values with
# weights_only=True, so a sharded checkpoint can no more run code on load than a full one.
_DCP_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"),
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" or (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"sharded checkpoint index refers to {module}.{name}, which a checkpoint never holds; "
                              "refusing to load it")


def _safe_reader(folder: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                metadata = _IndexUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(folder))


def _safe_planner():
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner()


SINGLE_PROCESS_WARNING = "torch.distributed is (disabled|unavailable)"


@contextlib.contextmanager
def quiet_single_process():
    """DCP warns on every single-process load or save, which is what evaluation and one-rank runs mean to do."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        yield


def load_sharded(state: dict[str, Any], folder: Path, process_group=None) -> None:
    """Fill ``state`` in place from the DCP shards in ``folder`` (any world size), with the safe reader and planner."""
    import torch.distributed.checkpoint as dcp

    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    single = not (dist.is_available() and dist.is_initialized())  # one process (a consumer, or a one-rank resume)
    try:
        with quiet_single_process():
            dcp.load(state, storage_reader=_safe_reader(folder), planner=_safe_planner(), process_group=process_group,
                     no_dist=single)
    except (Exception, CheckpointException) as e:  # DCP wraps each rank's error in one long traceback: keep the cause
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        cause = next((ln for ln in reversed(lines) if "Error" in ln.split(":")[0]), lines[-1] if lines else repr(e))
        raise CheckpointError(f"{folder}: the sharded checkpoint could not be loaded: {cause}") from e
