"""Pretraining: next-token prediction on token shards, validated by the token loss on held-out shards.

``python -m kiln.train --config job.json`` with task "pretrain" (kiln.train.job.JobConfig fields) runs it;
kiln.posttrain.sft.SftStage is the same stage on prompt-masked instruction pairs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kiln.model.masks import document_mask
from kiln.train.dist import DistInfo
from kiln.train.job import JobConfig
from kiln.train.telemetry import format_duration
from kiln.train.trainer import Stage, StepReport, Trainer

Batches = Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]]  # a fresh pass over (x, y) validation batches


def mask_kwargs(x: torch.Tensor, eot: int | None) -> dict[str, torch.Tensor]:
    """The model's extra forward arguments for inputs x (B, T): a document mask when ``eot`` is set, else none."""
    return {} if eot is None else {"attn_mask": document_mask(x, eot)}  # (B, 1, T, T) bool


def document_eot(job: JobConfig) -> int:
    """The end-of-text id separating the documents in the job's shards: ``eot_token`` of the manifest.json beside
    them (every folder's must agree), else the EOT of ``job.tokenizer``; an error naming both when neither is there."""
    from kiln.tokens.shards import MANIFEST, load_manifest

    found = {}
    for folder in sorted({Path(p).parent for p in [*job.train_files, *job.val_files]}):
        eot = load_manifest(folder).get("eot_token") if (folder / MANIFEST).is_file() else None
        if eot is not None:
            found[str(folder / MANIFEST)] = int(eot)
    if len(set(found.values())) > 1:
        raise ValueError(f"job.document_mask: the shard manifests disagree on eot_token: {found}; train on shards "
                         "of one tokenizer")
    if found:
        return next(iter(found.values()))
    if job.tokenizer:
        from kiln.tokens.tokenizer import load_encoding

        return load_encoding(job.tokenizer).eot_token
    first = job.train_files[0] if job.train_files else "(no train_files)"
    raise ValueError(f"job.document_mask needs the end-of-text token id: no {MANIFEST} with 'eot_token' beside "
                     f"{first} and job.tokenizer is empty; set job.tokenizer to the tokenizer.json the shards were "
                     "written with, or write them with kiln.tokens.shards.write_shards (which records eot_token)")


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Batches, info: DistInfo, autocast, eot: int | None = None) -> float:
    """Mean token cross-entropy over the validation batches (targets equal to -100 are skipped), over all ranks;
    with ``eot``, attention is masked to each document as in training."""
    model.eval()
    total, count = 0.0, 0
    for x, y in batches():
        x, y = x.to(info.device), y.to(info.device)
        with autocast():
            logits = model(x, **mask_kwargs(x, eot))  # (B, T, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-100, reduction="sum")
        total += loss.item()
        count += int((y != -100).sum())
    model.train()
    return global_mean(total, count, info)


def global_mean(total: float, count: int, info: DistInfo) -> float:
    """``total / count`` over every rank's sums (a pipeline's stages hold the same sums: the ratio is unchanged)."""
    if info.world_size > 1:
        t = torch.tensor([total, count], dtype=torch.float64)
        dist.all_reduce(t)
        total, count = t.tolist()
    return total / max(count, 1)


@torch.no_grad()
def evaluate_pipeline(trainer: Trainer, batches: Batches, eot: int | None = None) -> float:
    """``evaluate`` through the trainer's pipeline stages: the validation batches in groups of one step's
    micro-batches, forward only (the schedule's eval); the same mean over every rank."""
    pipe, info = trainer.pipe, trainer.info
    pipe.train(False)
    total, count, group = 0.0, 0, []

    def run() -> tuple[float, int]:
        x, y = (torch.cat(t).to(info.device) for t in zip(*group))
        with trainer.autocast():
            return pipe.eval_loss(x, y, **mask_kwargs(x, eot))

    for batch in batches():
        group.append(batch)
        if len(group) == pipe.microbatches:
            t, c = run()
            total, count, group = total + t, count + c, []
    if group:
        t, c = run()
        total, count = total + t, count + c
    pipe.train(True)
    return global_mean(total, count, info)


class NextTokenStage(Stage):
    """Mean next-token cross-entropy of (B, T) inputs against (B, T) targets through the model's chunked head
    (kiln.model.loss.LinearCrossEntropy); validation is the same loss on held-out batches. With ``eot`` (an
    end-of-text id), each token attends only within its document (kiln.model.masks.document_mask)."""

    def __init__(self, job: JobConfig, info: DistInfo, loader, val_batches: Batches, eot: int | None = None):
        self.job, self.info, self.loader, self.val_batches, self.eot = job, info, loader, val_batches, eot
        self.tokens_per_step = job.micro_batch * job.seq_len * job.grad_accum * info.data_world

    def batches(self, index: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(self.job.grad_accum):
            yield self.loader.next_batch()

    def loss(self, trainer: Trainer, batch) -> tuple[torch.Tensor, dict[str, float]]:
        x, y = (t.to(trainer.info.device, non_blocking=True) for t in batch)  # (B, T), (B, T)
        with trainer.autocast():
            return trainer.model(x, y, **mask_kwargs(x, self.eot)), {}

    def pipeline_batch(self, trainer: Trainer, index: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        x, y = (torch.cat(t).to(trainer.info.device) for t in zip(*self.batches(index)))  # (grad_accum B, T)
        return x, y, mask_kwargs(x, self.eot)

    def validate(self, trainer: Trainer) -> dict[str, float]:
        if trainer.pipe is not None:
            val = {"val_loss": evaluate_pipeline(trainer, self.val_batches, self.eot)}
            if self.eot is not None:
                val["val_loss_unmasked"] = evaluate_pipeline(trainer, self.val_batches)
            return val
        val = {"val_loss": evaluate(trainer.model, self.val_batches, trainer.info, trainer.autocast, self.eot)}
        if self.eot is not None:  # also attending across documents, as an unmasked run measures: comparable with it
            val["val_loss_unmasked"] = evaluate(trainer.model, self.val_batches, trainer.info, trainer.autocast)
        return val

    def start_line(self, val: dict[str, float]) -> str:
        return f"step 0: val loss {val['val_loss']:.4f}"

    def progress(self, r: StepReport) -> str:
        m = r.metrics
        val = r.val_loss if r.val_loss is not None else float("nan")
        mfu = f" | MFU {m['mfu']:.1%}" if "mfu" in m else ""
        return (f"step {r.step}/{r.max_steps}: loss {r.train['train_loss']:.4f} | val {val:.4f} | lr {m['lr']:.2e} | "
                f"grad_norm {m['grad_norm']:.2f} | {m['tokens_per_s']:,.0f} tok/s{mfu} | {m['memory_gb']:.2f} GiB | "
                f"{format_duration(r.left_s)} left")

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


class PretrainStage(NextTokenStage):
    """Windows of the token shards in a seeded order (kiln.tokens.loader.TokenLoader), each rank its own slice."""

    def __init__(self, job: JobConfig, info: DistInfo):
        from kiln.tokens.loader import TokenLoader, iter_eval_batches

        loader = TokenLoader([Path(p) for p in job.train_files], job.micro_batch, job.seq_len, info.data_rank,
                             info.data_world, job.seed)
        self.lora = job.lora  # enabled: adapters on the frozen init_from weights (continued pretraining)
        val_files = [Path(p) for p in job.val_files]
        super().__init__(job, info, loader,
                         lambda: iter_eval_batches(val_files, job.micro_batch, job.seq_len, job.eval_batches),
                         document_eot(job) if job.document_mask else None)
