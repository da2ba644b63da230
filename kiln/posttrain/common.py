"""What the DPO and RL stages share: their job fields, the frozen reference model, and reading their data.

Run either with ``python -m kiln.posttrain --config job.json`` (the job's task picks the stage; kiln.train.entry),
under torchrun with ``python -m torch.distributed.run --nproc_per_node=2 -m kiln.posttrain --config job.json``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Iterable

import torch

from kiln.common.config import ConfigError, Domain
from kiln.model.families import build_model
from kiln.model.lora import LoRAConfig, adapters_disabled
from kiln.posttrain.logprobs import model_token_logps
from kiln.posttrain.sft import read_pairs
from kiln.train.checkpoint import load_state, resolve_checkpoint
from kiln.train.dist import DistInfo
from kiln.train.job import TrainJob
from kiln.train.trainer import Stage, Trainer


@dataclass
class PosttrainJob(TrainJob):
    """A job that trains a policy from a checkpoint against a frozen reference (kiln.posttrain.dpo, kiln.posttrain.rl)."""

    task: str = ""  # "dpo" or "rl"
    train_files: list = field(default_factory=list)  # JSONL: preference pairs (dpo, reward: each file's train split) or
    # instruction pairs (rl, ppo: the first file)
    init_from: str = ""  # checkpoint the policy starts from (required)
    seq_len: Annotated[int, Domain(1)] = 256  # longest prompt + response, in tokens
    micro_batch: Annotated[int, Domain(1)] = 8  # pairs (dpo) or prompts (rl) per rank per forward
    eval_interval: Annotated[int, Domain(1)] = 25  # steps between held-out passes
    keep_last: Annotated[int, Domain(0)] = 1  # checkpoints kept on disk
    seed: Annotated[int, Domain(0)] = 1337  # seeds data order and sampling
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # enabled=true trains adapters on frozen weights
    reference: str = ""  # frozen reference checkpoint; empty means init_from

    def check(self, where: str = "job") -> None:
        super().check(where)
        if not self.init_from:
            raise ConfigError(f"{where}.init_from is empty: a {self.task} job starts from a trained checkpoint "
                              "(the SFT or DPO model)")
        if not self.train_files:
            raise ConfigError(f"{where}.train_files is empty: give the stage's pairs JSONL (preference_data or "
                              "instruction_data)")


class PosttrainStage(Stage):
    """A stage whose policy starts from ``init_from`` and is held to a frozen reference.

    The reference is the policy's own frozen base when LoRA is on and reference == init_from (no second copy);
    otherwise a separate model loaded from ``reference`` (default init_from) with gradients off.
    """

    def __init__(self, job: PosttrainJob, info: DistInfo):
        self.job, self.info = job, info
        self.lora = job.lora
        self.ref: torch.nn.Module | None = None

    def setup(self, trainer: Trainer) -> None:
        self.trainer = trainer
        job = self.job
        self.ref_path = trainer.ckpt.agree(lambda: str(resolve_checkpoint(job.reference))) if job.reference else trainer.init_ckpt
        if not (self.lora.enabled and self.ref_path == trainer.init_ckpt):
            self.ref = build_model(trainer.cfg)
            self.ref.load_state_dict(load_state(Path(self.ref_path), "cpu")[0]["model"])
            self.ref.to(trainer.info.device).eval().requires_grad_(False)
        self.init_note = f"; reference {self.ref_path}"

    @torch.no_grad()
    def reference_logps(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x, y (B, T) -> log p(y) (B, T) under the frozen reference, 0 where y is IGNORE (chunked head, no logits)."""
        with self.trainer.autocast():
            if self.ref is not None:
                return model_token_logps(self.ref, x, y)
            with adapters_disabled(self.trainer.raw):
                return model_token_logps(self.trainer.raw, x, y)

    def meta(self) -> dict[str, Any]:
        return {"init_from": self.trainer.init_ckpt, "reference": self.ref_path, "lora": asdict(self.lora)}

    def summary(self, trainer: Trainer) -> dict[str, Any]:
        return self.meta()


def read_jsonl_split(path: str, split: str, kinds: Iterable[str] | None = None) -> list[dict]:
    """Rows of one split (and kinds) from a pairs JSONL; an empty result is an error naming the file."""
    rows = [r for r in read_pairs(path, split) if kinds is None or r.get("kind") in set(kinds)]
    if not rows:
        raise ValueError(f"{path}: no '{split}' rows{f' of kind {sorted(kinds)}' if kinds else ''}; rebuild the data asset")
    return rows


@dataclass
class PreferenceSplits:
    """The pairs a preference stage (dpo, reward) trains and is held out on, and how many came from each file."""

    train: list[dict]  # the split=train rows of every training file, file by file
    val: list[dict]  # the split=val rows of the held-out file, at most eval_pairs
    train_by_file: list[int]  # training pairs taken from each of train_files, in order


def read_preference_splits(train_files: list, val_files: list, eval_pairs: int,
                           kinds: Iterable[str] | None = None) -> PreferenceSplits:
    """Training pairs: the split=train rows (of ``kinds``) of each of ``train_files``; held-out pairs: the split=val
    rows of ``val_files[0]``, else of ``train_files[0]``. A file's split=val rows never train, so held-out pairs stay
    held out whichever files are mixed in; a file with no training rows is an error naming it."""
    per_file = [read_jsonl_split(str(f), "train", kinds) for f in train_files]
    val = read_jsonl_split(str((val_files or train_files)[0]), "val", kinds)[:eval_pairs]
    return PreferenceSplits([r for rows in per_file for r in rows], val, [len(rows) for rows in per_file])
