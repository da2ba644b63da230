"""The training loop's checkpoints: ``Checkpointer`` saves and restores a run's whole state from every rank of a job,
in the background while training goes on, in the format kiln.train.checkpoint defines and verifies.

The trainer (kiln.train.trainer) alone uses this module; evaluation, post-training and release read checkpoints
through kiln.train.checkpoint.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import threading
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from kiln.model.tensor_parallel import canonical_state, interleaved_params, interleaved_state
from kiln.train.checkpoint import (SINGLE_PROCESS_WARNING, CheckpointError, clean_staging, commit_checkpoint,
                                   copy_extra_files, digest_tree, latest_good_checkpoint, load_sharded,
                                   load_state_file, prune_checkpoints, quiet_single_process, staging_dir, step_dir,
                                   weights_digest, write_state_file)
from kiln.train.diskfull import naming


# ---------------------------------------------------------------------------------------------- RNG state


def rng_state() -> dict[str, Any]:
    """This process's random generators (torch, Python, NumPy, CUDA), as values a weights_only load accepts."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": _numpy_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "numpy" in state:
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_state() -> list:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)]  # plain values: weights_only loads them


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


# ---------------------------------------------------------------------------------------------- saving and restoring


def _snapshot(obj: Any, memo: dict | None = None, pool: dict | None = None, where: tuple = ()) -> Any:
    """A CPU copy of a state dict that training can no longer change; tensors sharing storage (tied weights)
    stay shared, so the file holds them once. ``pool`` keeps the copies' memory between saves: copying into
    memory already touched is several times faster than into fresh pages."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        key = (obj.untyped_storage().data_ptr(), obj.storage_offset(), tuple(obj.shape), tuple(obj.stride()), obj.dtype)
        if key not in memo:
            spot = (where, tuple(obj.shape), obj.dtype)
            buf = pool.get(spot) if pool is not None else None
            if buf is None:
                buf = torch.empty(obj.shape, dtype=obj.dtype, device="cpu")
                if pool is not None:
                    pool[spot] = buf
            memo[key] = buf.copy_(obj.detach())
        return memo[key]
    if isinstance(obj, dict):
        return {k: _snapshot(v, memo, pool, (*where, k)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_snapshot(v, memo, pool, (*where, i)) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(_snapshot(v, memo, pool, (*where, i)) for i, v in enumerate(obj))
    return copy.deepcopy(obj)


class Checkpointer:
    """Saves and restores a run's whole state (model, optimizer, and the caller's extras: scheduler, loader,
    RNG of every rank, step) from every rank of a job, one save in flight at a time.

    ``sharded`` (FSDP2): every rank writes its shards with torch.distributed.checkpoint; otherwise rank 0 writes
    the full state. ``async_save``: the state is copied to CPU memory and written by a background thread while
    training goes on; ``wait`` blocks until it is committed. Rank 0 alone commits, prunes and logs.
    ``on_write(path)`` is called with each state file once it is written, before its checkpoint is committed.
    """

    def __init__(self, root: Path, rank: int, world_size: int, sharded: bool, async_save: bool, keep_last: int,
                 keep_every: int = 0, extra_files: dict[str, Path] | None = None, log: Callable[[str], None] = print,
                 on_write: Callable[[Path], None] | None = None):
        import torch.distributed as dist

        self.root, self.rank, self.world_size = Path(root), rank, world_size
        self.sharded, self.async_save = sharded, async_save
        self.keep_last, self.keep_every = keep_last, keep_every
        self.extra_files, self.log, self.on_write = extra_files or {}, log, on_write
        self.distributed = world_size > 1 and dist.is_initialized()
        # a separate gloo group: background saves then never interleave collectives with training's
        self.group = dist.new_group(backend="gloo") if self.distributed else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending: Path | None = None
        self._pool: dict = {}  # snapshot buffers, reused by every save (one save is in flight at a time)
        self.committed: list[Path] = []
        self.blocked_s = 0.0  # seconds the training loop spent waiting on saves
        if rank == 0:
            for p in clean_staging(self.root):
                log(f"removed {p.name}: a save that was interrupted (the checkpoints before it are intact)")

    # -- saving

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extras: dict[str, Any],
             meta: dict[str, Any], weights: Callable[[], dict[str, torch.Tensor]] | None = None) -> float:
        """Start saving checkpoint ``step`` (finishing the previous save first); return seconds blocked.

        ``weights`` (full checkpoints; called on rank 0) gives the state stored as "model" in place of the model's
        own: a LoRA run stores its merged weights there, so every reader gets plain GPT weights.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        t0 = time.perf_counter()
        self._join()
        meta = {**meta, "step": step, "format": "sharded" if self.sharded else "full", "saved_at": time.time()}
        tmp, final = staging_dir(self.root, step), step_dir(self.root, step)
        if self.sharded:  # the optimizer's state keyed by parameter name: it reshards to any layout, stages included
            meta["optim_state"] = "flat"
            msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
            if self.rank == 0:
                if tmp.exists():
                    shutil.rmtree(tmp)
                (tmp / "model").mkdir(parents=True)
            self._barrier()
            extras = _snapshot(extras)
            future = self._dcp_save({"model": msd, "optim": osd}, tmp / "model")
            work = lambda: self._finish_sharded(future, tmp, final, extras, meta)  # noqa: E731
        else:
            msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
            state = None
            if self.rank == 0:
                params = interleaved_params(model)  # GPT-2's q|k|v under tensor parallelism: saved in the model's order
                msd, osd = canonical_state(msd, params), canonical_state(osd, params)
                state = _snapshot({"model": weights() if weights else msd, "optimizer": osd, **extras}, pool=self._pool)
            work = lambda: self._write_full(state, tmp, final, meta) if self.rank == 0 else None  # noqa: E731
        self._pending = final
        if self.async_save:
            self._thread = threading.Thread(target=self._run, args=(work, tmp), name=f"kiln-save-{step}", daemon=True)
            self._thread.start()
        else:
            self._run(work, tmp)
            self._raise()
        blocked = time.perf_counter() - t0
        self.blocked_s += blocked
        return blocked

    def _dcp_save(self, state: dict[str, Any], folder: Path) -> Future:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        writer = FileSystemWriter(str(folder), sync_files=True)
        if not self.distributed:  # the background save runs in DCP's own thread, beyond catch_warnings' reach
            warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING, category=UserWarning)
        with quiet_single_process():
            if self.async_save:
                out = dcp.async_save(state, storage_writer=writer, process_group=self.group)
                return getattr(out, "upload_completion", out)
            with naming(folder):  # DCP's failed writes name no file
                dcp.save(state, storage_writer=writer, process_group=self.group)
        done: Future = Future()
        done.set_result(None)
        return done

    def _write_full(self, state: dict[str, Any], tmp: Path, final: Path, meta: dict[str, Any]) -> None:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        meta = {**meta, "weights_digest": weights_digest(state["model"])}
        files = {"state.pt": write_state_file(tmp / "state.pt", state, self.on_write)}
        files.update(copy_extra_files(tmp, self.extra_files))
        self._done(commit_checkpoint(tmp, final, files, meta))

    def _finish_sharded(self, future: Future, tmp: Path, final: Path, extras: dict[str, Any], meta: dict[str, Any]) -> None:
        with naming(tmp / "model"):  # DCP's failed writes name no file
            future.result()  # on rank 0 this returns once every rank's shards and the index are on disk
        if self.rank != 0:
            return
        files = {"state.pt": write_state_file(tmp / "state.pt", extras, self.on_write)}
        files.update(copy_extra_files(tmp, self.extra_files))
        files.update(digest_tree(tmp, set(files)))
        self._done(commit_checkpoint(tmp, final, files, meta))

    def _done(self, final: Path) -> None:
        self.committed.append(final)
        for old in prune_checkpoints(self.root, self.keep_last, self.keep_every):
            if old in self.committed:
                self.committed.remove(old)

    def _run(self, work: Callable[[], None], folder: Path) -> None:
        try:
            with naming(folder):  # a full disk names the folder being written when the failed write named no file
                work()
        except BaseException as e:  # surfaced by wait() on the training thread
            self._error = e

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"saving {self._pending} failed: {type(err).__name__}: {err}") from err

    def wait(self) -> float:
        """Block until the save in flight (if any) is committed; return seconds blocked. Raises if it failed."""
        waited = self._join()
        self.blocked_s += waited
        return waited

    def finish_after_crash(self, timeout_s: float = 120.0) -> bool:
        """Give the save in flight ``timeout_s`` to commit after the training thread failed; return whether it
        did. Its state was copied before the failure, so it is good; without this a crash loses every step since
        the checkpoint before it. Never raises: the crash being reported matters more than the save's own error."""
        thread, self._thread = self._thread, None
        if thread is None:
            return False
        thread.join(timeout_s)
        if thread.is_alive():
            self.log(f"the save of {self._pending} did not finish within {timeout_s:.0f} s of the crash; "
                     "the run resumes from the checkpoint before it")
            return False
        if self._error is not None:
            self.log(f"the save of {self._pending} failed too: {type(self._error).__name__}: {self._error}")
            self._error = None
            return False
        return True

    def _join(self) -> float:
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()
        return time.perf_counter() - t0

    def _barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    # -- loading

    def latest(self, before_step: int | None = None) -> Path | None:
        """The newest good checkpoint (rank 0 verifies checksums and tells the others)."""
        return self.agree(lambda: latest_good_checkpoint(self.root, self.log, before_step))

    def agree(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` computed on rank 0 (which reads and verifies files), received by every rank."""
        import torch.distributed as dist

        box = [fn() if self.rank == 0 else None]
        if self.distributed:
            dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, part: str = "model"
             ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Restore model (and optimizer) from checkpoint ``path`` whatever its format and world size, onto this
        model however it is wrapped; return (extras, meta). Checksums were verified by ``latest``.

        ``part`` names the entry holding the model's trained state: "model", or "lora" for a LoRA run's adapters
        (loaded onto its frozen base; full checkpoints only)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_state_dict,
            set_model_state_dict,
            set_state_dict,
        )

        path = Path(path)
        meta = json.loads((path / "meta.json").read_text())
        state = load_state_file(path / "state.pt")
        params = interleaved_params(model)  # rows this model holds in an order of its own (GPT-2's q|k|v under TP)
        if meta.get("format") == "sharded" and params:
            # DCP places shards by their offsets in the model's order: read whole tensors, then reorder them
            flat = meta.get("optim_state") == "flat"
            full = StateDictOptions(full_state_dict=True)
            msd, osd = (get_state_dict(model, optimizer, options=StateDictOptions(
                full_state_dict=True, flatten_optimizer_state_dict=flat)) if optimizer is not None
                else (get_model_state_dict(model, options=full), None))
            target = {"model": msd} if osd is None else {"model": msd, "optim": osd}
            load_sharded(target, path / "model", self.group)
            if osd is None:
                set_model_state_dict(model, interleaved_state(target["model"], params), options=full)
            else:
                if flat:  # torch loads a full optimizer state nested only: fill this optimizer's own from the file's
                    _, nested = get_state_dict(model, optimizer, options=full)
                    for name, entry in nested["state"].items():
                        entry.update({k: osd[f"state.{name}.{k}"] for k in entry if f"state.{name}.{k}" in osd})
                    for group in nested["param_groups"]:  # the learning rate and the rest, as saved
                        first = group["params"][0]
                        group.update({k: osd[f"param_groups.{first}.{k}"] for k in group
                                      if k != "params" and f"param_groups.{first}.{k}" in osd})
                    osd = nested
                set_state_dict(model, optimizer, model_state_dict=interleaved_state(target["model"], params),
                               optim_state_dict=interleaved_state(osd, params), options=full)
        elif meta.get("format") == "sharded":
            # older sharded checkpoints hold the optimizer's parameter groups as a list
            opts = StateDictOptions(flatten_optimizer_state_dict=meta.get("optim_state") == "flat")
            msd, osd = (get_state_dict(model, optimizer, options=opts) if optimizer is not None
                        else (get_model_state_dict(model), None))
            target = {"model": msd} if osd is None else {"model": msd, "optim": osd}
            load_sharded(target, path / "model", self.group)
            if osd is None:
                set_model_state_dict(model, target["model"])
            else:
                set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"],
                               options=opts)
        else:
            opts = StateDictOptions(full_state_dict=True, strict=part == "model")
            weights = interleaved_state(state[part], params)
            if optimizer is None or "optimizer" not in state:
                set_model_state_dict(model, weights, options=opts)
            else:
                set_state_dict(model, optimizer, model_state_dict=weights,
                               optim_state_dict=interleaved_state(state["optimizer"], params), options=opts)
        extras = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
        return extras, meta
