"""Proximal Policy Optimization against a learned reward model (RLHF; Ouyang et al., 2022), as a training stage.

One process:  python -m kiln.posttrain.ppo --config job.json    (PpoJob fields; init_from = SFT, reward_model = a reward run)
Several:      python -m torch.distributed.run --nproc_per_node=2 -m kiln.posttrain.ppo --config job.json
A rollout samples one answer per prompt with the KV-cache sampler; each answer token earns -kl_coef * (log pi -
log pi_ref), its last token also the reward model's score; GAE (gamma, lam) over a value model started from the
reward model gives advantages; ppo_epochs optimizer steps reuse each rollout with the clipped policy and value losses.
Written here rather than with TRL: TRL 1.x's PPOTrainer is built on Accelerate and Hugging Face model classes
(policy, value and reward models as transformers modules with its own generation), none of which Kiln's trainer,
checkpoints and torchrun launch use; the algorithm itself is the short functions below.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Annotated, Any, Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from kiln.common.config import ConfigError, Domain
from kiln.posttrain.common import PosttrainJob, PosttrainStage, read_jsonl_split
from kiln.posttrain.logprobs import model_token_logps
from kiln.posttrain.reward import RewardModel, load_reward_model, pad_ids, reward_ids
from kiln.posttrain.rl import answer_rows
from kiln.posttrain.sampling import complete, decode_completion
from kiln.posttrain.sft import IGNORE
from kiln.train.dist import DistInfo, all_mean
from kiln.train.entry import run_job
from kiln.train.spikes import SpikeConfig
from kiln.train.telemetry import Reporter, format_duration
from kiln.train.trainer import StepReport, Trainer
from kiln.train.optim import OptimConfig


@dataclass
class PpoJob(PosttrainJob):
    task: str = "ppo"
    reward_model: str = ""  # reward checkpoint (kiln.posttrain.reward) that scores answers; the value model starts from it
    prompt_kinds: list = field(default_factory=lambda: ["arithmetic"])  # instruction kinds prompts are drawn from
    max_new_tokens: Annotated[int, Domain(1)] = 16  # longest sampled answer, in tokens
    temperature: Annotated[float, Domain(0, low_open=True)] = 0.7  # sampling temperature of the rollouts
    kl_coef: Annotated[float, Domain(0)] = 0.05  # per-token KL penalty to the reference, in the reward
    gamma: Annotated[float, Domain(0, 1)] = 1.0  # discount of GAE
    lam: Annotated[float, Domain(0, 1)] = 0.95  # GAE's lambda
    clip_range: Annotated[float, Domain(0, low_open=True)] = 0.2  # PPO's policy ratio clip
    value_clip: Annotated[float, Domain(0, low_open=True)] = 0.2  # how far a value may move from its rollout value before its loss is clipped
    ppo_epochs: Annotated[int, Domain(1)] = 2  # optimizer steps per rollout (each on the whole rollout)
    value_lr: Annotated[float, Domain(0, low_open=True)] = 1e-4  # AdamW learning rate of the value model
    eval_items: Annotated[int, Domain(1)] = 50  # held-out (split=val) prompts answered greedily and scored by the reward model
    max_steps: Annotated[int, Domain(1)] = 30  # optimizer steps
    eval_interval: Annotated[int, Domain(1)] = 10  # steps between held-out passes
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-5, warmup_steps=5, min_lr_ratio=0.5,
                                                                   weight_decay=0.0))  # AdamW for the policy
    # the PPO loss is a surrogate whose level says little about health: only non-finite values roll back by default
    spikes: SpikeConfig = field(default_factory=lambda: SpikeConfig(enabled=False))

    def check(self, where: str = "job") -> None:
        super().check(where)
        if not self.reward_model:
            raise ConfigError(f"{where}.reward_model is empty: give the reward model checkpoint (the reward_model "
                              "asset's)")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x (N, T) over mask (N, T) != 0."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1)


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """x (N, T) shifted and scaled to mean 0, std 1 over the mask; 0 off it."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards, values, mask (N, T) -> (advantages, returns) (N, T), 0 off the mask.

    delta_t = r_t + gamma * V_{t+1} - V_t (V after the last answer token is 0); A_t = delta_t + gamma * lam * A_{t+1}.
    """
    mask = mask.to(values.dtype)
    n, t_len = values.shape
    adv = torch.zeros_like(values)  # (N, T)
    last = torch.zeros(n, dtype=values.dtype, device=values.device)  # (N,) A_{t+1}
    for t in reversed(range(t_len)):
        nxt = mask[:, t + 1] if t + 1 < t_len else torch.zeros_like(last)  # (N,) 1 where t+1 is an answer token
        next_value = values[:, t + 1] * nxt if t + 1 < t_len else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * nxt * last
        adv[:, t] = last * mask[:, t]
    return adv, (adv + values) * mask


def token_rewards(score: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                  kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """score (N,), token log-probs under policy and reference (N, T), mask (N, T) -> (rewards (N, T), kl (N, T)):
    -kl_coef * kl on every answer token, kl = log pi - log pi_ref, plus the score on each row's last answer token."""
    m = mask.to(logp.dtype)
    kl = (logp - ref_logp) * m  # (N, T)
    rewards = -kl_coef * kl  # (N, T)
    last = (m * torch.arange(m.size(1), device=m.device)).argmax(1)  # (N,) last answer position
    rewards[torch.arange(m.size(0), device=m.device), last] += score
    return rewards, kl


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                clip: float) -> tuple[torch.Tensor, float]:
    """PPO's clipped surrogate over (N, T) answer tokens -> (loss, share of tokens whose ratio was clipped)."""
    ratio = torch.exp(logp - old_logp)  # (N, T)
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)  # (N, T)
    frac = masked_mean(((ratio - 1).abs() > clip).float(), mask)
    return masked_mean(torch.maximum(unclipped, clipped), mask), float(frac)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float) -> torch.Tensor:
    """0.5 * max((V - R)^2, (V_clipped - R)^2) over (N, T) answer tokens, V_clipped within ``clip`` of the old V."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)  # (N, T)
    return 0.5 * masked_mean(torch.maximum((values - returns) ** 2, (clipped - returns) ** 2), mask)


def token_values(model: RewardModel, x: torch.Tensor) -> torch.Tensor:
    """x (N, T) -> the value head at every position (N, T): V of the state before emitting y[:, t]."""
    h = model.hidden(x)  # (N, T, C)
    return model.score(h.to(model.score.weight.dtype)).squeeze(-1).float()  # (N, T)


@torch.no_grad()
def rm_scores(rm: RewardModel, enc, prompts: list[str], texts: list[str], seq_len: int,
              device: torch.device | str) -> torch.Tensor:
    """The reward model's score of each (prompt, decoded answer): (N,)."""
    x, n = pad_ids([reward_ids(enc, p, t, seq_len) for p, t in zip(prompts, texts)], enc.eot_token)
    return rm(x.to(device), n.to(device))


@torch.no_grad()
def rollout(policy, reference_logps, value: RewardModel, rm: RewardModel, enc, prompts: list[str], job: PpoJob,
            generator: torch.Generator | None, device) -> dict[str, torch.Tensor]:
    """Sample one answer per prompt and compute what the PPO epochs reuse: x, y, mask, old log-probs and values,
    advantages, returns (N, T), and per-answer score, kl and length (N,)."""
    policy.eval()
    comps = complete(policy, enc, prompts, job.max_new_tokens, job.temperature, 1, generator, device)
    texts = [decode_completion(enc, c[0]) for c in comps]
    x, y = answer_rows(enc, prompts, comps, job.seq_len)
    x, y = x.to(device), y.to(device)  # (N, T)
    mask = (y != IGNORE).float()  # (N, T)
    logp, ref = model_token_logps(policy, x, y), reference_logps(x, y)  # (N, T)
    policy.train()
    values = token_values(value, x) * mask  # (N, T)
    score = rm_scores(rm, enc, prompts, texts, job.seq_len, device)  # (N,)
    rewards, kl = token_rewards(score, logp, ref, mask, job.kl_coef)
    adv, returns = gae(rewards, values, mask, job.gamma, job.lam)
    return {"x": x, "y": y, "mask": mask, "logp": logp, "values": values, "adv": whiten(adv, mask),
            "returns": returns, "score": score, "kl": kl.sum(1) / mask.sum(1).clamp(min=1), "length": mask.sum(1)}


def step_value(value: RewardModel, opt: torch.optim.Optimizer, loss: torch.Tensor, info: DistInfo,
               max_norm: float = 1.0) -> None:
    """One value-model update from ``loss``: gradients averaged over ranks, clipped, applied."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for p in value.parameters() if p.grad is not None]
    if info.world_size > 1:
        for p in params:
            dist.all_reduce(p.grad)
            p.grad /= info.world_size
    if max_norm > 0:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
    opt.step()


def ppo_losses(policy, value: RewardModel, buf: dict[str, torch.Tensor], job: PpoJob,
               autocast) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(policy loss, value loss, statistics) of one pass over a rollout ``buf``."""
    m = buf["mask"]
    with autocast():
        logp = model_token_logps(policy, buf["x"], buf["y"])  # (N, T)
        values = token_values(value, buf["x"])  # (N, T)
    pl, frac = policy_loss(logp, buf["logp"], buf["adv"], m, job.clip_range)
    vl = value_loss(values, buf["values"], buf["returns"], m, job.value_clip)
    approx_kl = float(masked_mean(buf["logp"] - logp.detach(), m))
    return pl, vl, {"policy_loss": float(pl.detach()), "value_loss": float(vl.detach()), "clip_frac": frac,
                    "approx_kl": approx_kl, "reward": float(buf["score"].mean()), "kl": float(buf["kl"].mean()),
                    "response_length": float(buf["length"].mean()), "return": float(masked_mean(buf["returns"], m))}


class PpoStage(PosttrainStage):
    """Rollouts from prompts drawn by (seed, rollout, rank), scored by a frozen reward model, each reused for
    ``ppo_epochs`` steps; the value model trains beside the policy. Held out: the greedy answers' reward-model score."""

    def __init__(self, job: PpoJob, info: DistInfo):
        from kiln.tokens.tokenizer import load_encoding

        self.enc = load_encoding(job.tokenizer)
        self.items = read_jsonl_split(job.train_files[0], "train", job.prompt_kinds)
        self.val_items = read_jsonl_split(job.train_files[0], "val", job.prompt_kinds)[: job.eval_items]
        self.buffer: tuple[int, list[dict[str, torch.Tensor]]] | None = None  # (rollout index, its micro-batches)
        super().__init__(job, info)

    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        device = trainer.info.device
        self.rm = load_reward_model(self.job.reward_model)[0].to(device).requires_grad_(False)
        self.value = load_reward_model(self.job.reward_model)[0].to(device).train()
        self.value_opt = torch.optim.AdamW([p for p in self.value.parameters() if p.requires_grad],
                                           lr=self.job.value_lr, weight_decay=0.0)
        self.init_note += f"; reward and value models from {self.job.reward_model}"

    def describe(self, trainer: Trainer) -> str:
        job = self.job
        return (f"PPO on {len(self.items)} prompts ({', '.join(job.prompt_kinds)}), {job.micro_batch * job.grad_accum} "
                f"answers per rollout, {job.ppo_epochs} epochs each, kl_coef {job.kl_coef}; {len(self.val_items)} held "
                f"out; {self.info.world_size} x {self.info.device.type}, steps {trainer.run.step}->{job.max_steps}")

    def rollout_batches(self, r: int) -> list[dict[str, torch.Tensor]]:
        """Rollout ``r``'s micro-batches; prompts and samples depend only on (seed, r, rank) and the policy."""
        job = self.job
        rng = np.random.default_rng([job.seed, r, self.info.rank])
        gen = torch.Generator(device=self.info.device).manual_seed(int(rng.integers(2**62)))
        out = []
        for _ in range(job.grad_accum):
            picked = rng.choice(len(self.items), size=min(job.micro_batch, len(self.items)), replace=False)
            out.append(rollout(self.trainer.raw, self.reference_logps, self.value, self.rm, self.enc,
                               [self.items[i]["prompt"] for i in picked], job, gen, self.info.device))
        return out

    def batches(self, index: int) -> Iterator[dict[str, torch.Tensor]]:
        # a resumed run within a rollout redraws that rollout (same prompts and seed) with the resumed policy
        r = index // self.job.ppo_epochs
        if self.buffer is None or self.buffer[0] != r:
            self.buffer = (r, self.rollout_batches(r))
        yield from self.buffer[1]

    def loss(self, trainer: Trainer, batch) -> tuple[torch.Tensor, dict[str, float]]:
        pl, vl, stats = ppo_losses(trainer.model, self.value, batch, self.job, trainer.autocast)
        step_value(self.value, self.value_opt, vl, self.info, trainer.opt_cfg.grad_clip)
        return pl, stats

    @torch.no_grad()
    def validate(self, trainer: Trainer) -> dict[str, float]:
        """Greedy answers to the held-out prompts: their mean reward-model score, KL to the reference and length."""
        mine = self.val_items[self.info.rank :: self.info.world_size]
        raw, device = trainer.raw, self.info.device
        raw.eval()
        prompts = [it["prompt"] for it in mine]
        comps = complete(raw, self.enc, prompts, self.job.max_new_tokens, device=device)
        texts = [decode_completion(self.enc, c[0]) for c in comps]
        x, y = answer_rows(self.enc, prompts, comps, self.job.seq_len)
        x, y = x.to(device), y.to(device)
        m = y != IGNORE
        kl = ((model_token_logps(raw, x, y) - self.reference_logps(x, y)) * m).sum(1) / m.sum(1).clamp(min=1)
        raw.train()
        score = rm_scores(self.rm, self.enc, prompts, texts, self.job.seq_len, device)
        return all_mean({"val_reward": float(score.mean()), "val_kl": float(kl.mean()),
                         "val_response_length": float(m.sum(1).float().mean())}, self.info)

    def history_row(self, step: int, train: dict[str, float], val: dict[str, float] | None) -> dict:
        keys = ("reward", "kl", "value_loss", "policy_loss", "clip_frac", "response_length", "approx_kl")
        return {"step": step, **{k: train[k] for k in keys}, **(val or {})}

    def start_line(self, val: dict[str, float]) -> str:
        return f"step 0: held-out reward {val['val_reward']:.3f}, KL {val['val_kl']:.4f}"

    def progress(self, r: StepReport) -> str:
        t = r.train
        return (f"step {r.step}/{r.max_steps}: reward {t['reward']:.3f} | kl {t['kl']:.4f} | policy loss "
                f"{t['policy_loss']:.4f} | value loss {t['value_loss']:.4f} | clip {t['clip_frac']:.2f} | "
                f"length {t['response_length']:.1f}" + (f" | held-out reward {r.val['val_reward']:.3f}" if r.val else "")
                + f" | {format_duration(r.left_s)} left")

    def meta(self) -> dict[str, Any]:
        return {**super().meta(), "reward_model": self.job.reward_model}

    def summary(self, trainer: Trainer) -> dict[str, Any]:
        vals = [h for h in trainer.run.history if "val_reward" in h]
        job = self.job
        return {**super().summary(trainer), "kl_coef": job.kl_coef, "ppo_epochs": job.ppo_epochs,
                "prompts": {"train": len(self.items), "val": len(self.val_items)},
                "initial_val_reward": vals[0]["val_reward"] if vals else None,
                "final_val_reward": vals[-1]["val_reward"] if vals else None,
                "initial_val_kl": vals[0]["val_kl"] if vals else None, "final_val_kl": vals[-1]["val_kl"] if vals else None,
                "final_train": trainer.last_stats or None}

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value.state_dict(), "value_optim": self.value_opt.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value.load_state_dict(state["value"])
        self.value_opt.load_state_dict(state["value_optim"])


def main(argv: list[str] | None = None, reporter: Reporter | None = None, callbacks: Iterable = ()) -> dict[str, Any]:
    return run_job(PpoJob, PpoStage, __doc__, argv, reporter, callbacks)


if __name__ == "__main__":
    main(sys.argv[1:])
