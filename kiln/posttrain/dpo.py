"""Direct Preference Optimization (Rafailov et al., 2023) against a frozen reference model, as a training job.

One process:  python -m kiln.posttrain.dpo --config job.json          (DpoJob fields; init_from = the SFT checkpoint)
Several:      python -m torch.distributed.run --nproc_per_node=2 -m kiln.posttrain.dpo --config job.json
The loss is written here rather than taken from TRL: TRL's trainer needs Hugging Face models and datasets, and
the loss itself is a few lines over summed response log-probabilities.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from kiln.model.parallel import gradient_sync
from kiln.posttrain.common import PosttrainJob, PosttrainRun, run_job, read_jsonl_split, sequence_logps
from kiln.posttrain.sft import PackedLoader, encode_example, pad_rows, to_xy, trim_padding
from kiln.train.loop import DistInfo, Reporter


@dataclass
class DpoJob(PosttrainJob):
    task: str = "dpo"
    beta: float = 0.1  # strength of the implicit KL constraint: larger stays closer to the reference
    label_smoothing: float = 0.0  # assumed share of flipped labels (conservative DPO); 0 is plain DPO
    eval_pairs: int = 256  # held-out (split=val) pairs scored at each evaluation


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, label_smoothing: float = 0.0):
    """Summed response log-probs, each (B,) -> (loss scalar, chosen rewards (B,), rejected rewards (B,)).

    reward = beta * (log pi(y|x) - log pi_ref(y|x));  loss = -log sigmoid(reward_chosen - reward_rejected),
    averaged over pairs (with label smoothing eps: (1-eps) of that plus eps of the flipped pair's loss).
    """
    chosen_rewards = beta * (policy_chosen - ref_chosen)  # (B,)
    rejected_rewards = beta * (policy_rejected - ref_rejected)  # (B,)
    margin = chosen_rewards - rejected_rewards  # (B,)
    losses = -(1 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)
    return losses.mean(), chosen_rewards.detach(), rejected_rewards.detach()


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


def pair_stats(policy_logps: torch.Tensor, ref_logps: torch.Tensor, beta: float, label_smoothing: float) -> dict[str, Any]:
    """Loss and the reported quantities for (2B,) policy and reference log-probs (chosen rows first)."""
    b = policy_logps.size(0) // 2
    loss, cr, rr = dpo_loss(policy_logps[:b], policy_logps[b:], ref_logps[:b], ref_logps[b:], beta, label_smoothing)
    stats = {
        "reward_accuracy": float((cr > rr).float().mean()),  # the policy moved towards the chosen response more
        "reward_margin": float((cr - rr).mean()),
        "chosen_reward": float(cr.mean()), "rejected_reward": float(rr.mean()),
        "chosen_logp": float(policy_logps[:b].detach().mean()), "rejected_logp": float(policy_logps[b:].detach().mean()),
        "preference_accuracy": float((policy_logps[:b] > policy_logps[b:]).float().mean()),  # reference-free
    }
    return {"loss_tensor": loss, "loss": float(loss.detach()), **stats}


@torch.no_grad()
def evaluate_pairs(run: PosttrainRun, tokens: np.ndarray, mask: np.ndarray, job: DpoJob) -> dict[str, float]:
    """Mean DPO statistics over held-out pairs; each rank scores its own share, then the means are averaged."""
    run.raw.eval()
    rows = np.arange(run.info.rank, len(tokens), run.info.world_size)
    totals: dict[str, float] = {}
    n = 0
    for i in range(0, len(rows), job.micro_batch):
        idx = rows[i : i + job.micro_batch]
        x, y = pair_batch(tokens[idx], mask[idx])
        x, y = x.to(run.info.device), y.to(run.info.device)
        with run.autocast():
            logps = sequence_logps(run.raw(x), y)  # (2B,)
        stats = pair_stats(logps, sequence_logps(run.reference_logits(x), y), job.beta, job.label_smoothing)
        for k, v in stats.items():
            if k != "loss_tensor":
                totals[k] = totals.get(k, 0.0) + v * len(idx)
        n += len(idx)
    run.raw.train()
    means = {k: v / max(n, 1) for k, v in totals.items()}
    return run.all_mean(means)


def train(job: DpoJob, info: DistInfo, reporter: Reporter) -> dict[str, Any]:
    """Run DPO to max_steps, resuming from the newest good checkpoint in out_dir; return the summary."""
    from kiln.tokenizer import load_encoding

    if not job.train_files:
        raise ValueError("job.train_files is empty: give the preference_data pairs JSONL")
    enc = load_encoding(job.tokenizer)
    train_rows = read_jsonl_split(job.train_files[0], "train")
    val_rows = read_jsonl_split(job.train_files[0], "val")[: job.eval_pairs]
    tt, tm = encode_preferences(enc, train_rows, job.seq_len)
    vt, vm = encode_preferences(enc, val_rows, job.seq_len)
    if len(train_rows) < job.micro_batch * info.world_size:
        raise ValueError(f"{job.train_files[0]}: {len(train_rows)} training pairs cannot fill one batch of "
                         f"{job.micro_batch} x {info.world_size} ranks; lower micro_batch or add preference data")
    run = PosttrainRun(job, info, reporter)
    loader = PairLoader(tt, tm, job.micro_batch, info.rank, info.world_size, job.seed)
    if run.extra_state.get("loader"):
        loader.load_state_dict(run.extra_state["loader"])
    run.say(f"DPO on {len(train_rows)} pairs (beta {job.beta}), {len(val_rows)} held out; "
            f"{info.world_size} x {info.device.type}, steps {run.step}->{job.max_steps}")
    t_start = time.time()
    first = None
    if run.step == 0:
        first = evaluate_pairs(run, vt, vm, job)
        run.history.append({"step": 0, **{f"val_{k}": v for k, v in first.items()}})
        run.logger.log({f"val_{k}": v for k, v in first.items()}, 0)
    last_ckpt, train_stats = None, {}
    run.model.train()
    while run.step < job.max_steps:
        t0 = time.time()
        acc: dict[str, float] = {}
        for micro in range(job.grad_accum):
            x, y = loader.next_batch()
            x, y = x.to(info.device), y.to(info.device)
            ref = sequence_logps(run.reference_logits(x), y)  # (2B,)
            with gradient_sync(run.ddp, micro == job.grad_accum - 1), run.autocast():
                stats = pair_stats(sequence_logps(run.ddp(x), y), ref, job.beta, job.label_smoothing)
            (stats.pop("loss_tensor") / job.grad_accum).backward()
            for k, v in stats.items():
                acc[k] = acc.get(k, 0.0) + v / job.grad_accum
        norm = run.optimizer_step()
        train_stats = run.all_mean(acc)
        metrics = {**train_stats, "grad_norm": norm, "lr": run.scheduler.get_last_lr()[0], "step_s": time.time() - t0}
        run.logger.log(metrics, run.step)
        val = None
        if run.step % job.eval_interval == 0 or run.step == job.max_steps:
            val = evaluate_pairs(run, vt, vm, job)
            run.history.append({"step": run.step, **{f"train_{k}": train_stats[k] for k in ("loss", "reward_accuracy", "reward_margin")},
                                **{f"val_{k}": v for k, v in val.items()}})
            run.logger.log({f"val_{k}": v for k, v in val.items()}, run.step)
        if run.step % job.log_interval == 0 or run.step == job.max_steps:
            run.say(f"step {run.step}/{job.max_steps}: loss {train_stats['loss']:.4f} reward acc {train_stats['reward_accuracy']:.2f} "
                    f"margin {train_stats['reward_margin']:.3f} chosen {train_stats['chosen_logp']:.2f} "
                    f"rejected {train_stats['rejected_logp']:.2f} grad_norm {norm:.2f}")
        if run.step % job.ckpt_interval == 0 or run.step == job.max_steps:
            last_ckpt = run.save({"loader": loader.state_dict()})
    run.logger.flush()
    vals = [h for h in run.history if "val_loss" in h]
    return run.summary(last_ckpt, t_start, pairs={"train": len(train_rows), "val": len(val_rows)}, beta=job.beta,
                       initial_val=_strip(vals[0]) if vals else None, final_val=_strip(vals[-1]) if vals else None,
                       final_train=train_stats or None, final_val_loss=vals[-1]["val_loss"] if vals else None)


def _strip(h: dict) -> dict:
    return {k[4:]: v for k, v in h.items() if k.startswith("val_")}


def main(argv: list[str] | None = None, reporter: Reporter | None = None) -> dict[str, Any]:
    return run_job(DpoJob, train, __doc__, argv, reporter)


if __name__ == "__main__":
    main(sys.argv[1:])
