"""Reinforcement learning with verifiable rewards: GRPO-style group-relative advantages and a KL penalty to a reference.

One process:  python -m kiln.posttrain.rl --config job.json          (RlJob fields; init_from = the DPO or SFT checkpoint)
Several:      python -m torch.distributed.run --nproc_per_node=2 -m kiln.posttrain.rl --config job.json
Each step samples ``group_size`` answers per prompt, scores them with an exact checker, and pushes up answers that
beat their group's mean (Shao et al., 2024). Written here rather than with TRL, whose trainer needs Hugging Face models.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from kiln.common.config import ConfigError
from kiln.posttrain.common import PosttrainJob, PosttrainStage, read_jsonl_split
from kiln.posttrain.instructions import arithmetic_reward, final_number
from kiln.posttrain.logprobs import model_token_logps
from kiln.posttrain.sampling import complete, decode_completion
from kiln.posttrain.sft import IGNORE, chat_prompt_ids, pad_rows, to_xy, trim_padding
from kiln.train.dist import DistInfo
from kiln.train.entry import run_job
from kiln.train.spikes import SpikeConfig
from kiln.train.telemetry import Reporter, format_duration
from kiln.train.trainer import StepReport, Trainer

RewardFn = Callable[[str, dict], float]  # (decoded response, item) -> reward

def arithmetic_near_miss(text: str, item: dict) -> float:
    """How close a wrong final number is: 1 - |error| / 10, floored at 0 (0 for the exact answer or no number)."""
    got = final_number(text)
    if got is None or got == str(item["answer"]):
        return 0.0
    return max(0.0, 1.0 - abs(int(got) - int(item["answer"])) / 10)


# checkable tasks: name -> (instruction kinds it draws prompts from, exact reward, partial credit for a near miss)
REWARDS: dict[str, tuple[tuple[str, ...], RewardFn, RewardFn]] = {
    "arithmetic": (("arithmetic",), lambda text, item: arithmetic_reward(text, item["answer"]), arithmetic_near_miss),
}


def make_reward(task: str, partial_credit: float) -> RewardFn:
    """The training reward: 1 for the exact answer, else ``partial_credit`` times the task's near-miss score
    (both computed from the checkable answer; 0 gives the exact check alone)."""
    _, exact, near = REWARDS[task]
    if partial_credit == 0:
        return exact
    return lambda text, item: exact(text, item) or partial_credit * near(text, item)


@dataclass
class RlJob(PosttrainJob):
    task: str = "rl"
    reward: str = "arithmetic"  # checkable task (a key of kiln.posttrain.rl.REWARDS)
    group_size: int = 8  # answers sampled per prompt; advantages are relative within each group
    max_new_tokens: int = 16  # longest sampled answer, in tokens
    temperature: float = 1.0  # sampling temperature for the groups
    partial_credit: float = 0.0  # reward scale for a near miss (arithmetic: within 10 of the answer); 0 is exact only
    kl_coef: float = 0.05  # weight of the per-token KL penalty to the reference (k3 estimator)
    eval_items: int = 100  # held-out (split=val) prompts answered greedily at each evaluation
    # the GRPO loss is a surrogate whose level says little about health: only non-finite values roll back by default
    spikes: SpikeConfig = field(default_factory=lambda: SpikeConfig(enabled=False))

    def check(self, where: str = "job") -> None:
        super().check(where)
        if self.reward not in REWARDS:
            raise ConfigError(f"{where}.reward {self.reward!r} is not a checkable task; choose from {', '.join(REWARDS)}")
        if self.group_size < 2:
            raise ConfigError(f"{where}.group_size must be >= 2 (advantages are relative within a group), "
                              f"got {self.group_size}")


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """rewards (P, G) -> advantages (P, G): each reward minus its group's mean, over the group's std.

    A group whose answers all score the same carries no signal and gets zero advantage.
    """
    mean = rewards.mean(dim=1, keepdim=True)  # (P, 1)
    std = rewards.std(dim=1, keepdim=True) if rewards.size(1) > 1 else torch.zeros_like(mean)  # (P, 1)
    return (rewards - mean) / (std + eps)


def grpo_loss(logp: torch.Tensor, ref_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              kl_coef: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Token log-probs of the sampled answers under policy and reference (N, T), advantages (N,), mask (N, T).

    One update per batch of samples (on-policy), so GRPO's clipped ratio pi/pi_old is exactly 1 and its gradient
    is the policy gradient A * grad log pi. The KL to the reference uses the k3 estimator exp(d) - d - 1 with
    d = log pi_ref - log pi (non-negative, unbiased). Per-token terms are averaged per answer, then over answers.
    """
    mask = mask.float()
    ratio = torch.exp(logp - logp.detach())  # (N, T), equal to 1 with the policy's gradient
    delta = ref_logp - logp  # (N, T)
    kl = torch.exp(delta) - delta - 1  # (N, T)
    per_token = -ratio * advantages[:, None] + kl_coef * kl  # (N, T)
    lengths = mask.sum(1).clamp(min=1)  # (N,)
    loss = ((per_token * mask).sum(1) / lengths).mean()
    kl_mean = float(((kl.detach() * mask).sum(1) / lengths).mean())
    return loss, {"kl": kl_mean}


def answer_rows(enc, prompts: list[str], completions: list[list[list[int]]], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sampled answer after its prompt, one row each: x, y (P*G, T) with targets on the answer tokens only."""
    examples = []
    for prompt, group in zip(prompts, completions):
        p = chat_prompt_ids(enc, prompt)
        examples += [(p + c, [0] * len(p) + [1] * len(c)) for c in group]
    tokens, mask = pad_rows(examples, seq_len, enc.eot_token)
    return trim_padding(*to_xy(tokens, mask))


def rollout_loss(policy: torch.nn.Module, sampler: torch.nn.Module,
                 reference_logps: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 enc, items: list[dict], reward_fn: RewardFn, job: RlJob, generator: torch.Generator | None = None,
                 device: torch.device | str = "cpu", autocast=contextlib.nullcontext,
                 checks: dict[str, RewardFn] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Sample groups for ``items`` with ``sampler`` (the unwrapped policy), score them, and return the GRPO loss
    computed through ``policy`` (which may be DDP-wrapped) with the reported statistics (``checks`` adds the mean
    of other scores of the same samples, e.g. the exact answer alone when the reward also counts format).
    ``reference_logps(x, y)`` gives the reference's token log-probs (N, T) (PosttrainStage.reference_logps)."""
    was_training = sampler.training
    sampler.eval()
    prompts = [it["prompt"] for it in items]
    comps = complete(sampler, enc, prompts, job.max_new_tokens, job.temperature, job.group_size, generator, device)
    sampler.train(was_training)
    texts = [[decode_completion(enc, c) for c in group] for group in comps]
    rewards = torch.tensor([[reward_fn(t, it) for t in group] for group, it in zip(texts, items)],
                           dtype=torch.float32)  # (P, G)
    adv = group_advantages(rewards).flatten().to(device)  # (P*G,)
    x, y = answer_rows(enc, prompts, comps, job.seq_len)
    x, y = x.to(device), y.to(device)
    ref = reference_logps(x, y)  # (N, T)
    with autocast():
        logp = model_token_logps(policy, x, y)  # (N, T)
    loss, stats = grpo_loss(logp, ref, adv, y != IGNORE, job.kl_coef)
    stats.update({
        "reward_mean": float(rewards.mean()),
        "reward_group_std": float(rewards.std(dim=1).mean()) if job.group_size > 1 else 0.0,
        "groups_with_signal": float((rewards.std(dim=1) > 0).float().mean()) if job.group_size > 1 else 0.0,
        "answer_tokens": float((y != IGNORE).sum(1).float().mean()),
        "loss": float(loss.detach()),
        **{name: float(sum(fn(t, it) for group, it in zip(texts, items) for t in group) / rewards.numel())
           for name, fn in (checks or {}).items()},
    })
    return loss, stats


@torch.no_grad()
def heldout_reward(model: torch.nn.Module, enc, items: list[dict], reward_fn: RewardFn, max_new_tokens: int,
                   info: DistInfo) -> float:
    """Mean reward of greedy answers to ``items``; each rank answers its share, the result is the global mean."""
    was_training = model.training
    mine = items[info.rank :: info.world_size]
    outs = complete(model, enc, [it["prompt"] for it in mine], max_new_tokens, device=info.device) if mine else []
    model.train(was_training)
    total = sum(reward_fn(decode_completion(enc, o[0]), it) for o, it in zip(outs, mine))
    if info.world_size > 1:
        t = torch.tensor([total, len(mine)], dtype=torch.float64, device=info.device if info.device.type == "cuda" else "cpu")
        dist.all_reduce(t)
        total, n = t.tolist()
        return total / max(n, 1)
    return total / max(len(mine), 1)


class RlStage(PosttrainStage):
    """Prompts drawn by (seed, batch, rank), groups of sampled answers scored by an exact checker, the GRPO loss;
    the held-out measure is the greedy answers' exact reward."""

    def __init__(self, job: RlJob, info: DistInfo):
        from kiln.tokenizer import load_encoding

        kinds, self.exact_fn, _ = REWARDS[job.reward]
        self.reward_fn = make_reward(job.reward, job.partial_credit)
        self.enc = load_encoding(job.tokenizer)
        self.items = read_jsonl_split(job.train_files[0], "train", kinds)
        self.val_items = read_jsonl_split(job.train_files[0], "val", kinds)[: job.eval_items]
        super().__init__(job, info)

    def describe(self, trainer: Trainer) -> str:
        job = self.job
        return (f"GRPO on {len(self.items)} {job.reward} prompts, {job.group_size} answers each, kl_coef {job.kl_coef}; "
                f"{len(self.val_items)} held out; {self.info.world_size} x {self.info.device.type}, "
                f"steps {trainer.run.step}->{job.max_steps}")

    def batches(self, index: int) -> Iterator[tuple[list[dict], torch.Generator]]:
        # prompts and samples depend only on (seed, batch, rank): a resumed run draws what the original would have
        job = self.job
        rng = np.random.default_rng([job.seed, index, self.info.rank])
        gen = torch.Generator(device=self.info.device).manual_seed(int(rng.integers(2**62)))
        for _ in range(job.grad_accum):
            yield [self.items[i] for i in rng.choice(len(self.items), size=min(job.micro_batch, len(self.items)),
                                                     replace=False)], gen

    def loss(self, trainer: Trainer, batch) -> tuple[torch.Tensor, dict[str, float]]:
        items, gen = batch
        return rollout_loss(trainer.model, trainer.raw, self.reference_logps, self.enc, items, self.reward_fn, self.job,
                            gen, trainer.info.device, trainer.autocast, checks={"exact_answer": self.exact_fn})

    def validate(self, trainer: Trainer) -> dict[str, float]:
        return {"val_reward": heldout_reward(trainer.raw, self.enc, self.val_items, self.exact_fn,
                                             self.job.max_new_tokens, self.info)}

    def history_row(self, step: int, train: dict[str, float], val: dict[str, float] | None) -> dict:
        return {"step": step, "reward": train["reward_mean"], "exact_answer": train["exact_answer"], "kl": train["kl"],
                **(val or {})}

    def start_line(self, val: dict[str, float]) -> str:
        return f"step 0: held-out reward {val['val_reward']:.3f}"

    def progress(self, r: StepReport) -> str:
        t, m = r.train, r.metrics
        return (f"step {r.step}/{r.max_steps}: reward {t['reward_mean']:.3f} | exact {t['exact_answer']:.3f} | "
                f"kl {t['kl']:.4f} | groups with signal {t['groups_with_signal']:.2f} | answer tokens {t['answer_tokens']:.1f}"
                + (f" | held-out reward {r.val['val_reward']:.3f}" if r.val else "")
                + (f" | {m['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in m else "") + f" | {format_duration(r.left_s)} left")

    def summary(self, trainer: Trainer) -> dict[str, Any]:
        job = self.job
        vals = [h["val_reward"] for h in trainer.run.history if "val_reward" in h]
        return {**super().summary(trainer), "reward": job.reward, "group_size": job.group_size, "kl_coef": job.kl_coef,
                "partial_credit": job.partial_credit, "prompts": {"train": len(self.items), "val": len(self.val_items)},
                "initial_val_reward": vals[0] if vals else None, "final_val_reward": vals[-1] if vals else None,
                "final_train": trainer.last_stats or None}


def main(argv: list[str] | None = None, reporter: Reporter | None = None, callbacks: Iterable = ()) -> dict[str, Any]:
    return run_job(RlJob, RlStage, __doc__, argv, reporter, callbacks)


if __name__ == "__main__":
    main(sys.argv[1:])
