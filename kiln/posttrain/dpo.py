"""Preference optimisation as a training stage: Direct Preference Optimization (Rafailov et al., 2023) against a frozen
reference model, or another loss of kiln.posttrain.preference_losses (``loss``: dpo, ipo, simpo, kto).

One process:  python -m kiln.posttrain.dpo --config job.json          (DpoJob fields; init_from = the SFT checkpoint)
Several:      python -m torch.distributed.run --nproc_per_node=2 -m kiln.posttrain.dpo --config job.json
The loss is written here rather than taken from TRL: TRL's trainer needs Hugging Face models and datasets, and
the loss itself is a few lines over summed response log-probabilities.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Annotated, Any, Iterable, Iterator

import numpy as np
import torch

from kiln.common.config import Domain
from kiln.posttrain.common import PosttrainJob, PosttrainStage, read_preference_splits
from kiln.posttrain.logprobs import grouped_sequence_logps, model_sequence_logps
from kiln.posttrain.sft import PackedLoader, encode_example, pad_rows, to_xy, trim_padding
from kiln.train.dist import DistInfo, all_mean
from kiln.train.entry import run_job
from kiln.train.telemetry import Reporter, format_duration
from kiln.train.trainer import StepReport, Trainer
from kiln.train.optim import OptimConfig


@dataclass
class DpoJob(PosttrainJob):
    task: str = "dpo"
    max_steps: Annotated[int, Domain(1)] = 40  # optimizer steps
    micro_batch: Annotated[int, Domain(1)] = 16  # pairs per rank per forward
    eval_interval: Annotated[int, Domain(1)] = 20  # steps between held-out passes
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4, warmup_steps=10, weight_decay=0.0))  # AdamW for DPO
    loss: str = "dpo"  # the preference loss (kiln.posttrain.preference_losses): dpo, ipo, simpo (no reference), kto
    beta: Annotated[float, Domain(0)] = 0.0  # the loss's beta (dpo: the implicit KL strength; ipo: tau); 0: its paper's default (dpo, ipo,
    # kto 0.1; simpo 2.0)
    label_smoothing: Annotated[float, Domain(0, 0.5, high_open=True)] = 0.0  # dpo: assumed share of flipped labels (conservative DPO); 0 is plain DPO
    simpo_gamma_ratio: Annotated[float, Domain(0)] = 0.5  # simpo: the target reward margin gamma as a share of beta (the paper's 0.5)
    kto_desirable_weight: Annotated[float, Domain(0)] = 1.0  # kto: lambda_D, the weight of the chosen (desirable) responses
    kto_undesirable_weight: Annotated[float, Domain(0)] = 1.0  # kto: lambda_U, the weight of the rejected (undesirable) responses
    eval_pairs: Annotated[int, Domain(1)] = 256  # held-out (split=val) pairs scored at each evaluation
    val_files: list = field(default_factory=list)  # the held-out pairs' JSONL (its split=val rows); empty: train_files[0]

    def check(self, where: str = "job") -> None:
        super().check(where)
        from kiln.common.config import ConfigError
        from kiln.posttrain.preference_losses import preference_loss

        preference_loss(self.loss, where)  # an unknown name lists the known ones
        if self.label_smoothing and self.loss != "dpo":
            raise ConfigError(f"{where}.label_smoothing applies to loss dpo, not {self.loss!r}: set it to 0")

    def settings(self):
        """The loss's settings (each LossSettings field is this job's field of that name), beta resolved (0: the
        paper's default)."""
        from kiln.posttrain.preference_losses import LOSS_FIELDS, LossSettings, preference_loss

        values = {name: getattr(self, name) for name in LOSS_FIELDS}
        return LossSettings(**{**values, "beta": self.beta or preference_loss(self.loss).beta})


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, label_smoothing: float = 0.0):
    """Summed response log-probs, each (B,) -> (loss scalar, chosen rewards (B,), rejected rewards (B,)): DPO's loss
    (kiln.posttrain.preference_losses.dpo), averaged over pairs.

    reward = beta * (log pi(y|x) - log pi_ref(y|x));  loss = -log sigmoid(reward_chosen - reward_rejected)
    (with label smoothing eps: (1-eps) of that plus eps of the flipped pair's loss).
    """
    from kiln.posttrain.preference_losses import LossSettings, PairLogps, dpo

    ones = torch.ones_like(policy_chosen)
    losses, chosen, rejected = dpo(PairLogps(policy_chosen, policy_rejected, ref_chosen, ref_rejected, ones, ones),
                                   LossSettings(beta, label_smoothing))
    return losses.mean(), chosen.detach(), rejected.detach()


def encode_preferences(enc, rows: list[dict], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Preference rows -> tokens (N, 2, W) and mask (N, 2, W): [:, 0] chosen, [:, 1] rejected, prompt masked."""
    examples = []
    for r in rows:
        examples.append(encode_example(enc, r["prompt"], r["chosen"]))
        examples.append(encode_example(enc, r["prompt"], r["rejected"]))
    tokens, mask = pad_rows(examples, seq_len, enc.eot_token)  # (2N, W)
    return tokens.reshape(len(rows), 2, -1), mask.reshape(len(rows), 2, -1)


def pair_batch(tokens: np.ndarray, mask: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 2, W) pairs -> x, y (2B, T): the B chosen rows first, then the B rejected rows, trailing padding cut."""
    x, y = to_xy(np.concatenate([tokens[:, 0], tokens[:, 1]]), np.concatenate([mask[:, 0], mask[:, 1]]))
    return trim_padding(x, y)


class PairLoader(PackedLoader):
    """Shuffled, rank-disjoint, resumable batches of preference pairs (PackedLoader's order over pairs)."""

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.next_indices()
        return pair_batch(self.tokens[idx], self.mask[idx])


def pair_stats(policy_logps: torch.Tensor, ref_logps: torch.Tensor | None, settings, loss_name: str = "dpo",
               tokens: torch.Tensor | None = None) -> dict[str, Any]:
    """Loss and the reported quantities for (2B,) policy and reference log-probs (chosen rows first; the reference
    None for a loss without one) and the responses' token counts (2B,), under the preference loss ``loss_name``
    (kiln.posttrain.preference_losses) with ``settings`` (LossSettings)."""
    from kiln.posttrain.preference_losses import PairLogps, preference_loss

    b = policy_logps.size(0) // 2
    tokens = (tokens if tokens is not None else torch.ones_like(policy_logps)).to(policy_logps.dtype)
    rc, rr = (ref_logps[:b], ref_logps[b:]) if ref_logps is not None else (None, None)
    pairs = PairLogps(policy_logps[:b], policy_logps[b:], rc, rr, tokens[:b], tokens[b:])
    losses, cr, rr = preference_loss(loss_name).fn(pairs, settings)
    loss, cr, rr = losses.mean(), cr.detach(), rr.detach()
    stats = {
        "reward_accuracy": float((cr > rr).float().mean()),  # the policy moved towards the chosen response more
        "reward_margin": float((cr - rr).mean()),
        "chosen_reward": float(cr.mean()), "rejected_reward": float(rr.mean()),
        "chosen_logp": float(policy_logps[:b].detach().mean()), "rejected_logp": float(policy_logps[b:].detach().mean()),
        "preference_accuracy": float((policy_logps[:b] > policy_logps[b:]).float().mean()),  # reference-free
    }
    return {"loss_tensor": loss, "loss": float(loss.detach()), **stats}




class DpoStage(PosttrainStage):
    """Preference pairs in a seeded order; the DPO loss against the reference; held-out pair statistics."""

    def __init__(self, job: DpoJob, info: DistInfo):
        from kiln.tokens.tokenizer import load_encoding

        enc = load_encoding(job.tokenizer)
        self.pairs = read_preference_splits(job.train_files, job.val_files, job.eval_pairs)
        self.train_rows, self.val_rows = self.pairs.train, self.pairs.val
        tt, tm = encode_preferences(enc, self.train_rows, job.seq_len)
        self.vt, self.vm = encode_preferences(enc, self.val_rows, job.seq_len)
        if len(self.train_rows) < job.micro_batch * info.world_size:
            raise ValueError(f"{', '.join(map(str, job.train_files))}: {len(self.train_rows)} training pairs cannot fill one batch of "
                             f"{job.micro_batch} x {info.world_size} ranks; lower micro_batch or add preference data")
        super().__init__(job, info)
        self.settings = job.settings()
        self.loader = PairLoader(tt, tm, job.micro_batch, info.rank, info.world_size, job.seed)

    def setup(self, trainer: Trainer) -> None:
        from kiln.posttrain.preference_losses import preference_loss

        if preference_loss(self.job.loss).reference:
            return super().setup(trainer)
        self.trainer, self.ref_path = trainer, None  # a reference-free loss: no second model is loaded
        self.init_note = f"; no reference model (loss {self.job.loss})"

    def describe(self, trainer: Trainer) -> str:
        return (f"{self.job.loss.upper()} on {len(self.train_rows)} pairs (beta {self.settings.beta:g}), "
                f"{len(self.val_rows)} held out; "
                f"{self.info.world_size} x {self.info.device.type}, steps {trainer.run.step}->{self.job.max_steps}")

    def reference_sums(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Each row's summed log-prob under the reference (2B,), or None for a reference-free loss."""
        return grouped_sequence_logps(self.reference_logps, x, y) if self.ref_path is not None else None

    def batches(self, index: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(self.job.grad_accum):
            yield self.loader.next_batch()

    def loss(self, trainer: Trainer, batch) -> tuple[torch.Tensor, dict[str, float]]:
        x, y = (t.to(trainer.info.device) for t in batch)  # (2B, T): chosen rows, then rejected rows
        ref = self.reference_sums(x, y)  # (2B,)
        with trainer.autocast():
            stats = pair_stats(model_sequence_logps(trainer.model, x, y), ref, self.settings, self.job.loss,
                               (y != -100).sum(-1))
        return stats.pop("loss_tensor"), stats

    @torch.no_grad()
    def validate(self, trainer: Trainer) -> dict[str, float]:
        """Mean DPO statistics over held-out pairs; each rank scores its own share, then the means are averaged."""
        raw, job = trainer.raw, self.job
        raw.eval()
        rows = np.arange(self.info.rank, len(self.vt), self.info.world_size)
        totals: dict[str, float] = {}
        n = 0
        for i in range(0, len(rows), job.micro_batch):
            idx = rows[i : i + job.micro_batch]
            x, y = pair_batch(self.vt[idx], self.vm[idx])
            x, y = x.to(self.info.device), y.to(self.info.device)
            with trainer.autocast():
                logps = model_sequence_logps(raw, x, y)  # (2B,)
            ref = self.reference_sums(x, y)
            stats = pair_stats(logps, ref, self.settings, job.loss, (y != -100).sum(-1))
            for k, v in stats.items():
                if k != "loss_tensor":
                    totals[k] = totals.get(k, 0.0) + v * len(idx)
            n += len(idx)
        raw.train()
        means = all_mean({k: v / max(n, 1) for k, v in totals.items()}, self.info)
        return {f"val_{k}": v for k, v in means.items()}

    def history_row(self, step: int, train: dict[str, float], val: dict[str, float] | None) -> dict | None:
        if val is None:
            return None
        return {"step": step, **{f"train_{k}": train[k] for k in ("loss", "reward_accuracy", "reward_margin")}, **val}

    def progress(self, r: StepReport) -> str:
        t, m = r.train, r.metrics
        tok = f" | {m['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in m else ""
        return (f"step {r.step}/{r.max_steps}: loss {t['loss']:.4f} | reward acc {t['reward_accuracy']:.2f} | "
                f"margin {t['reward_margin']:.3f} | chosen {t['chosen_logp']:.2f} | "
                f"rejected {t['rejected_logp']:.2f} | grad_norm {m['grad_norm']:.2f}{tok} | {format_duration(r.left_s)} left")

    def summary(self, trainer: Trainer) -> dict[str, Any]:
        vals = [h for h in trainer.run.history if "val_loss" in h]
        return {**super().summary(trainer), "pairs": {"train": len(self.train_rows), "val": len(self.val_rows),
                                                    "train_by_file": self.pairs.train_by_file},
                "loss": self.job.loss, "beta": self.settings.beta,
                "initial_val": _strip(vals[0]) if vals else None,
                "final_val": _strip(vals[-1]) if vals else None, "final_train": trainer.last_stats or None,
                "final_val_loss": vals[-1]["val_loss"] if vals else None}

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


def _strip(h: dict) -> dict:
    return {k[4:]: v for k, v in h.items() if k.startswith("val_")}


def main(argv: list[str] | None = None, reporter: Reporter | None = None, callbacks: Iterable = ()) -> dict[str, Any]:
    return run_job(DpoJob, DpoStage, __doc__, argv, reporter, callbacks)


if __name__ == "__main__":
    main(sys.argv[1:])
