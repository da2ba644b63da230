"""Reinforcement learning with verifiable rewards: GRPO-style group-relative advantages and a KL penalty to a reference,
or with DAPO's changes (``algorithm: dapo``).

One process:  python -m kiln.posttrain.rl --config job.json          (RlJob fields; init_from = the DPO or SFT checkpoint)
Several:      python -m torch.distributed.run --nproc_per_node=2 -m kiln.posttrain.rl --config job.json
Each step samples ``group_size`` answers per prompt, scores them with an exact checker, and pushes up answers that
beat their group's mean (Shao et al., 2024). DAPO (Yu et al., 2025, "DAPO: An Open-Source LLM Reinforcement Learning
System at Scale", arXiv 2503.14476) adds four options, each a field of its own: a higher upper clip of the ratio
(clip-higher, with ``ppo_epochs`` > 1 for the ratio to move), a token-level loss, dynamic sampling of the groups that
carry signal, and a soft penalty for answers near the length limit. Written here rather than with TRL, whose trainer
needs Hugging Face models.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from fractions import Fraction
from typing import Annotated, Any, Callable, Iterable, Iterator, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from kiln.common.config import ConfigError, Domain
from kiln.posttrain.common import PosttrainJob, PosttrainStage, read_jsonl_split
from kiln.posttrain.instructions import arithmetic_reward, final_number
from kiln.posttrain.logprobs import encode_rows, grouped_sequence_logps, model_sequence_logps, model_token_logps
from kiln.posttrain.sampling import complete, decode_completion
from kiln.posttrain.sft import IGNORE, chat_prompt_ids, pad_rows, to_xy, trim_padding
from kiln.train.dist import DistInfo
from kiln.train.entry import run_job
from kiln.train.spikes import SpikeConfig
from kiln.train.telemetry import Reporter, format_duration
from kiln.train.trainer import StepReport, Trainer
from kiln.train.optim import OptimConfig

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
class RlSettings:
    """RL's algorithm hyper-parameters, GRPO's or DAPO's: each declared here once, with its default, its Domain and its
    comment. RlJob takes them as fields of its own (a job file and the rl_model asset's config give them flat), and
    RlJob.settings() resolves them: a field left None takes ``algorithm``'s value (ALGORITHMS)."""

    group_size: Annotated[int, Domain(2)] = 8  # answers sampled per prompt; advantages are relative within each group
    kl_coef: Annotated[float, Domain(0)] = 0.1  # weight of the per-token KL penalty to the reference (k3 estimator)
    # grpo or dapo: what eps_low, eps_high, loss_aggregation, dynamic_sampling and overlong_buffer take when left unset
    # (dapo: the paper's clip 0.2 / 0.28, token-level loss, dynamic sampling, an overlong buffer of max_new_tokens
    # // 5). DAPO also drops the KL term; algorithm leaves kl_coef as it is set (0 for the paper's recipe)
    algorithm: str = "grpo"
    # optimizer steps per sampled batch, each on all of it against the log-probs it was sampled with (max_steps counts
    # steps: a run samples max_steps / ppo_epochs batches); 1 is on-policy, one update per batch (GRPO's)
    ppo_epochs: Annotated[int, Domain(1)] = 1
    # the ratio pi/pi_old is clipped to [1 - eps_low, 1 + eps_high] (it moves only with ppo_epochs > 1: the first
    # update of a batch has ratio 1). Unset: grpo 0.2 / 0.2; dapo 0.2 / 0.28, DAPO's clip-higher (section 3.1)
    eps_low: Annotated[float | None, Domain(0, 1, low_open=True, high_open=True, none=True)] = None
    eps_high: Annotated[float | None, Domain(0, low_open=True, none=True)] = None
    # how per-token terms make the loss: sequence (each answer's mean, then the mean over answers) or token (a group's
    # terms summed over its token count, then the mean over groups; DAPO section 3.3). Unset: grpo sequence, dapo token
    loss_aggregation: str | None = None
    # drop prompt groups whose answers all score the same (no advantage) and sample more prompts until micro_batch
    # groups carry signal or max_sampling_rounds is reached (DAPO's dynamic sampling, 3.2). Unset: grpo off, dapo on
    dynamic_sampling: bool | None = None
    max_sampling_rounds: Annotated[int, Domain(1)] = 3  # dynamic sampling: rounds of micro_batch prompts sampled at most per micro-batch
    # DAPO's soft overlong punishment (3.4): an answer longer than max_new_tokens - overlong_buffer tokens loses reward
    # linearly, down to -1 at max_new_tokens; 0 is off. Unset: grpo 0; dapo max_new_tokens // 5 (the paper's 4K of 20K)
    overlong_buffer: Annotated[int | None, Domain(0, none=True)] = None
    # weight of a supervised term added to each step's loss: the mean negative log-likelihood per token of micro_batch
    # of the task's reference answers (training split), InstructGPT's PPO-ptx (Ouyang et al. 2022, eq. 2) with the
    # task's own supervised pairs in place of pretraining text. After DPO it narrows the held-out preference margin
    # further (bench/results/digit_split.md); preference_coef is the term that keeps it. 0 is off
    ptx_coef: Annotated[float, Domain(0)] = 0.0
    # weight of DPO's loss (Rafailov et al. 2023; beta preference_beta, against the reference: the starting weights) on
    # micro_batch pairs of preference_file's training split, added to each step's loss: the preference stage's own
    # objective replayed, so that RL after DPO keeps what DPO taught (the held-out preference margin) while the
    # policy term trains the task. 0 is off
    preference_coef: Annotated[float, Domain(0)] = 0.1
    preference_beta: Annotated[float, Domain(0, low_open=True)] = 0.1  # DPO's beta for the replayed pairs (the dpo stage's default)

    def check_choices(self, where: str) -> None:
        """The named choices (algorithm, loss_aggregation) known: a ConfigError naming the key and the choices."""
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"{where}.algorithm {self.algorithm!r} is not known; choose from {', '.join(ALGORITHMS)}")
        if self.loss_aggregation is not None and self.loss_aggregation not in AGGREGATIONS:
            raise ConfigError(f"{where}.loss_aggregation {self.loss_aggregation!r} is not known; choose from "
                              f"{', '.join(AGGREGATIONS)} or leave it unset for the algorithm's")

    def resolved(self, max_new_tokens: int) -> RlSettings:
        """These settings with each field left None taking ``algorithm``'s value (a share of max_new_tokens where the
        preset gives a Fraction, rounded down)."""
        preset = ALGORITHMS[self.algorithm]
        values = {}
        for f in fields(RlSettings):
            value = getattr(self, f.name)
            if value is None:
                value = getattr(preset, f.name)
                value = int(value * max_new_tokens) if isinstance(value, Fraction) else value
            values[f.name] = value
        return RlSettings(**values)

    def describe(self) -> str:
        """What resolved settings change from plain on-policy GRPO, for the start line ("" when nothing does)."""
        parts = []
        if self.ppo_epochs > 1:
            parts.append(f"{self.ppo_epochs} updates per sampled batch, ratio clipped to "
                         f"[{1 - self.eps_low:g}, {1 + self.eps_high:g}]")
        if self.loss_aggregation == "token":
            parts.append("token-level loss")
        if self.dynamic_sampling:
            parts.append(f"dynamic sampling (at most {self.max_sampling_rounds} rounds)")
        if self.overlong_buffer:
            parts.append(f"overlong penalty over the last {self.overlong_buffer} tokens")
        return ", ".join(parts)


# a new RL hyper-parameter is one RlSettings field (its default, Domain and comment) and its use: RlJob, its
# settings() and the rl_model asset's fields follow from this list
RL_SETTINGS = tuple(f.name for f in fields(RlSettings))

# what each algorithm gives the fields left unset (None). DAPO's are the paper's (arXiv 2503.14476): the clip range
# 0.2 / 0.28 (section 3.1), dynamic sampling (3.2), the token-level loss (3.3), and the soft overlong punishment
# over the last 4,096 of 20,480 tokens (3.4), here the same fifth of max_new_tokens
ALGORITHMS: dict[str, RlSettings] = {
    "grpo": RlSettings(algorithm="grpo", eps_low=0.2, eps_high=0.2, loss_aggregation="sequence", dynamic_sampling=False,
                       overlong_buffer=0),
    "dapo": RlSettings(algorithm="dapo", eps_low=0.2, eps_high=0.28, loss_aggregation="token", dynamic_sampling=True,
                       overlong_buffer=Fraction(1, 5)),  # type: ignore[arg-type]
}
AGGREGATIONS = ("sequence", "token")


@dataclass
class RlJob(RlSettings, PosttrainJob):
    task: str = "rl"
    reward: str = "arithmetic"  # checkable task (a key of kiln.posttrain.rl.REWARDS)
    max_new_tokens: Annotated[int, Domain(1)] = 16  # longest sampled answer, in tokens
    temperature: Annotated[float, Domain(0, low_open=True)] = 0.7  # sampling temperature for the groups
    partial_credit: Annotated[float, Domain(0, 1)] = 0.2  # reward scale for a near miss (arithmetic: within 10 of the answer); 0 is exact only
    max_steps: Annotated[int, Domain(1)] = 120  # optimizer steps
    eval_interval: Annotated[int, Domain(1)] = 20  # steps between held-out passes
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-5, warmup_steps=5, min_lr_ratio=0.5,
                                                                   weight_decay=0.0))  # AdamW for RL
    eval_items: Annotated[int, Domain(1)] = 100  # held-out (split=val) prompts answered greedily at each evaluation
    # the GRPO loss is a surrogate whose level says little about health: only non-finite values roll back by default
    spikes: SpikeConfig = field(default_factory=lambda: SpikeConfig(enabled=False))
    preference_file: str = ""  # preference pairs JSONL (preference_data's), needed when preference_coef > 0

    def check(self, where: str = "job") -> None:
        super().check(where)
        if self.reward not in REWARDS:
            raise ConfigError(f"{where}.reward {self.reward!r} is not a checkable task; choose from {', '.join(REWARDS)}")
        self.check_choices(where)
        if self.parallelism == "fsdp":  # a two-rank run hung so (tests/kiln/posttrain/test_rl.py)
            raise ConfigError(f"{where}.parallelism 'fsdp': each rank samples its answers for as many decoding steps "
                              "as its own answers need, and an FSDP2-sharded model gathers its weights on every "
                              "forward, so the ranks would wait on each other; set parallelism to 'ddp' (or 'auto')")
        if self.preference_coef and not self.preference_file:
            raise ConfigError(f"{where}.preference_coef {self.preference_coef} needs preference_file (the pairs to replay)")
        if self.overlong_buffer is not None and not 0 <= self.overlong_buffer <= self.max_new_tokens:
            raise ConfigError(f"{where}.overlong_buffer must be between 0 (off) and max_new_tokens "
                              f"({self.max_new_tokens}), got {self.overlong_buffer}")

    def settings(self) -> RlSettings:
        """This job's RlSettings fields, each left unset taking ``algorithm``'s value."""
        return self.resolved(self.max_new_tokens)


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """rewards (P, G) -> advantages (P, G): each reward minus its group's mean, over the group's std.

    A group whose answers all score the same carries no signal and gets zero advantage.
    """
    mean = rewards.mean(dim=1, keepdim=True)  # (P, 1)
    std = rewards.std(dim=1, keepdim=True) if rewards.size(1) > 1 else torch.zeros_like(mean)  # (P, 1)
    return (rewards - mean) / (std + eps)


def grpo_loss(logp: torch.Tensor, ref_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              kl_coef: float, *, old_logp: torch.Tensor | None = None, eps_low: float = 0.2, eps_high: float = 0.2,
              aggregation: str = "sequence", group_size: int = 0) -> tuple[torch.Tensor, dict[str, float]]:
    """Token log-probs of the sampled answers under policy and reference (N, T), advantages (N,), mask (N, T); and
    ``old_logp`` (N, T) under the policy that sampled them, when the policy may have moved since (ppo_epochs > 1).

    The policy term is PPO's clipped surrogate -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) per token, r = pi/pi_old,
    with DAPO's decoupled clip range (section 3.1). Without ``old_logp`` the update is on-policy: r is exactly 1, no
    clip can bind, and the term is -r A with r = exp(logp - logp.detach()), whose gradient is the policy gradient
    A * grad log pi (GRPO's one update per batch). The KL to the reference uses the k3
    estimator exp(d) - d - 1 with d = log pi_ref - log pi (non-negative, unbiased).

    ``aggregation`` sequence: per-token terms are averaged per answer, then over answers. token: each group's terms
    (``group_size`` consecutive rows; 0: all rows are one group) are summed over the group's answer tokens, then the
    groups averaged, so every token of a group weighs the same however long its answer (DAPO section 3.3).
    Statistics: kl (per answer, then over answers, either way) and, with ``old_logp``, clip_frac: the share of answer
    tokens whose gradient the clip cut (r above 1 + eps_high with A > 0, or below 1 - eps_low with A < 0).
    """
    mask = mask.float()
    if old_logp is None:
        ratio = torch.exp(logp - logp.detach())  # (N, T), equal to 1 with the policy's gradient
        policy = -ratio * advantages[:, None]  # (N, T)
    else:
        ratio = torch.exp(logp - old_logp)  # (N, T)
        adv = advantages[:, None]  # (N, 1)
        policy = -torch.min(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)  # (N, T)
    delta = ref_logp - logp  # (N, T)
    kl = torch.exp(delta) - delta - 1  # (N, T)
    per_token = policy + kl_coef * kl  # (N, T)
    lengths = mask.sum(1).clamp(min=1)  # (N,)
    if aggregation == "sequence":
        loss = ((per_token * mask).sum(1) / lengths).mean()
    elif aggregation == "token":
        g = group_size or per_token.size(0)
        if per_token.size(0) % g:
            raise ValueError(f"grpo_loss: {per_token.size(0)} rows are not whole groups of {g}")
        sums = (per_token * mask).sum(1).view(-1, g).sum(1)  # (P,)
        loss = (sums / mask.sum(1).view(-1, g).sum(1).clamp(min=1)).mean()
    else:
        raise ValueError(f"grpo_loss: aggregation {aggregation!r} is not one of {', '.join(AGGREGATIONS)}")
    stats = {"kl": float(((kl.detach() * mask).sum(1) / lengths).mean())}
    if old_logp is not None:
        r, a = ratio.detach(), advantages[:, None]
        cut = ((r > 1 + eps_high) & (a > 0)) | ((r < 1 - eps_low) & (a < 0))  # (N, T)
        stats["clip_frac"] = float((cut * mask).sum() / mask.sum().clamp(min=1))
    return loss, stats


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int) -> torch.Tensor:
    """DAPO's soft overlong punishment (section 3.4) of answers ``lengths`` tokens long (end-of-text included), any
    shape: 0 up to max_new_tokens - buffer tokens, then down linearly to -1 at max_new_tokens (so a cut-off answer
    gets -1); 0 everywhere when buffer is 0."""
    if buffer <= 0:
        return torch.zeros(lengths.shape)
    return ((max_new_tokens - buffer - lengths.float()) / buffer).clamp(-1.0, 0.0)


def informative(rewards: torch.Tensor) -> torch.Tensor:
    """rewards (P, G) -> (P,) True for a group whose answers do not all score the same: its advantages are not all 0.
    With an exact reward these are DAPO's groups with some but not all answers right (section 3.2)."""
    return rewards.amax(1) > rewards.amin(1)


def answer_rows(enc, prompts: list[str], completions: list[list[list[int]]], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sampled answer after its prompt, one row each: x, y (P*G, T) with targets on the answer tokens only."""
    examples = []
    for prompt, group in zip(prompts, completions):
        p = chat_prompt_ids(enc, prompt)
        examples += [(p + c, [0] * len(p) + [1] * len(c)) for c in group]
    tokens, mask = pad_rows(examples, seq_len, enc.eot_token)
    return trim_padding(*to_xy(tokens, mask))


@dataclass
class Rollout:
    """One micro-batch of sampled, scored groups as the loss takes it; with ppo_epochs > 1 it is kept for the sampled
    batch's later updates."""

    x: torch.Tensor  # (N, T) each answer after its prompt, N = groups * group_size, a group's rows together
    y: torch.Tensor  # (N, T) the answer tokens as targets, IGNORE elsewhere
    advantages: torch.Tensor  # (N,) group-relative
    ref_logp: torch.Tensor  # (N, T) under the frozen reference
    stats: dict[str, float]  # of the sampling: rewards, answer tokens, groups filtered
    old_logp: torch.Tensor | None = None  # (N, T) under the policy that sampled (set by the first update, if kept)


class Groups(NamedTuple):
    """Sampled groups to train on (sample_groups)."""

    items: list[dict]  # their prompts' items
    completions: list[list[list[int]]]  # completions[prompt][sample], token lists
    rewards: torch.Tensor  # (P, G) reward_fn's score of each answer
    stats: dict[str, float]  # of every answer sampled, filtered ones included
    signal: bool  # False when dynamic sampling found no group with signal: these are the last round's, a stand-in
    tokens: int  # tokens sampled in every round, filtered groups included


def sample_groups(sampler: torch.nn.Module, enc, rounds: list[list[dict]], reward_fn: RewardFn, job: RlJob,
                  generator: torch.Generator | None, device: torch.device | str,
                  checks: dict[str, RewardFn] | None = None) -> Groups:
    """Sample ``group_size`` answers to each prompt of ``rounds[0]`` with ``sampler`` and score them with ``reward_fn``.

    With dynamic sampling (DAPO section 3.2) groups whose answers all score the same are dropped, and the prompts of
    the next rounds sampled in turn until len(rounds[0]) groups carry signal (the first that many are kept) or the
    rounds (at most max_sampling_rounds) run out; a batch short of groups trains on fewer. If no group carries signal
    the last round's are kept with ``signal`` False (sample_rollout gives them no advantage), so that every rank still
    runs its forward and backward. The statistics cover every sampled answer (``checks``: the mean of other scores of
    them, e.g. the exact answer alone)."""
    settings = job.settings()
    want = len(rounds[0])
    sampled: list[tuple[list[dict], list[list[str]], torch.Tensor]] = []  # (items, texts, rewards) of each round
    kept: list[tuple[dict, list[list[int]], torch.Tensor]] = []  # (item, completions, rewards (G,))
    was_training, drawn = sampler.training, 0  # drawn: tokens sampled in every round
    sampler.eval()
    for items in rounds[: settings.max_sampling_rounds if settings.dynamic_sampling else 1]:
        comps = complete(sampler, enc, [it["prompt"] for it in items], job.max_new_tokens, job.temperature,
                         job.group_size, generator, device)
        texts = [[decode_completion(enc, c) for c in group] for group in comps]
        rewards = torch.tensor([[reward_fn(t, it) for t in group] for group, it in zip(texts, items)],
                               dtype=torch.float32)  # (P, G)
        sampled.append((items, texts, rewards))
        drawn += sum(len(c) for group in comps for c in group)
        keep = informative(rewards) if settings.dynamic_sampling else torch.ones(len(items), dtype=torch.bool)
        kept += [(it, c, r) for it, c, r, k in zip(items, comps, rewards, keep.tolist()) if k]
        if len(kept) >= want:
            break
    sampler.train(was_training)
    signal = bool(kept)
    if not signal:  # nothing to learn from: the last round stands in
        kept = list(zip(items, comps, rewards))
    kept = kept[:want]
    every = torch.cat([r for _, _, r in sampled])  # (every sampled group, G)
    stats = {
        "reward_mean": float(every.mean()),
        "reward_group_std": float(every.std(dim=1).mean()) if job.group_size > 1 else 0.0,
        "groups_with_signal": float((every.std(dim=1) > 0).float().mean()) if job.group_size > 1 else 0.0,
        **{name: float(sum(fn(t, it) for its, texts, _ in sampled for group, it in zip(texts, its) for t in group)
                       / every.numel()) for name, fn in (checks or {}).items()},
    }
    if settings.dynamic_sampling:
        stats.update(sampling_rounds=float(len(sampled)), groups_filtered=float((~informative(every)).sum()),
                     groups_trained=float(len(kept)))
    return Groups([it for it, _, _ in kept], [c for _, c, _ in kept], torch.stack([r for _, _, r in kept]), stats,
                  signal, drawn)


def sample_rollout(sampler: torch.nn.Module, reference_logps: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   enc, items: list[dict], reward_fn: RewardFn, job: RlJob, generator: torch.Generator | None = None,
                   device: torch.device | str = "cpu", checks: dict[str, RewardFn] | None = None,
                   refills: list[list[dict]] = ()) -> Rollout:
    """Sample and score groups for ``items`` (and dynamic sampling's ``refills``, a round of prompts each) with
    ``sampler`` (the unwrapped policy); the advantages come from the reward plus any overlong penalty (which does not
    decide what dynamic sampling keeps: like the paper's filter on accuracy, that is the reward's alone).
    ``reference_logps(x, y)`` gives the reference's token log-probs (N, T) (PosttrainStage.reference_logps)."""
    settings = job.settings()
    t0 = time.perf_counter()
    items, comps, rewards, stats, signal, tokens = sample_groups(sampler, enc, [items, *refills], reward_fn, job,
                                                                 generator, device, checks)
    seconds = time.perf_counter() - t0
    stats.update(rollout_s=seconds, rollout_tokens_per_s=tokens / max(seconds, 1e-9))
    if settings.overlong_buffer:
        penalty = overlong_penalty(torch.tensor([[len(c) for c in group] for group in comps]), job.max_new_tokens,
                                   settings.overlong_buffer)  # (P, G)
        rewards = rewards + penalty
        stats["overlong_penalty"] = float(penalty.mean())
    adv = group_advantages(rewards).flatten().to(device)  # (P*G,)
    if not signal:  # groups dynamic sampling filtered out: the length penalty alone is not to be learnt from them
        adv = torch.zeros_like(adv)
    x, y = answer_rows(enc, [it["prompt"] for it in items], comps, job.seq_len)
    x, y = x.to(device), y.to(device)
    ref = reference_logps(x, y)  # (N, T)
    stats["answer_tokens"] = float((y != IGNORE).sum(1).float().mean())
    return Rollout(x, y, adv, ref, stats)


class Preferences(NamedTuple):
    """Preference pairs replayed beside a rollout (RlJob.preference_coef): M chosen rows, then their M rejected rows."""

    x: torch.Tensor  # (2M, T)
    y: torch.Tensor  # (2M, T) the responses as targets, IGNORE elsewhere
    ref_logp: torch.Tensor  # (2M,) each response's summed log-prob under the reference


def rollout_policy_loss(policy: torch.nn.Module, rollout: Rollout, job: RlJob,
                        autocast=contextlib.nullcontext, ptx: tuple[torch.Tensor, torch.Tensor] | None = None,
                        preferences: Preferences | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one update on ``rollout`` through ``policy`` (which may be DDP-wrapped), with the sampling's and
    the loss's statistics. With ppo_epochs > 1 the first update keeps its log-probs as pi_old for the later ones.

    ``ptx``: reference answers x, y (M, T') whose mean token negative log-likelihood, times job.ptx_coef, is added
    (``ptx_loss``). ``preferences``: pairs whose DPO loss, times job.preference_coef, is added (``preference_loss``,
    ``preference_reward_accuracy``). Each batch takes a forward of its own and one backward takes their sum: stacked
    in one forward, the rollout's short rows were padded to the width of the longest replayed pair (on the demo, 64
    rows of about 25 tokens to up to 215): the demo's RL step took 3.44 s stacked and 1.25-1.39 s apart
    (bench/results/rl_step_before.md, rl_step_after.md). The replayed pairs' rows run in groups of similar length
    (kiln.posttrain.logprobs.grouped_sequence_logps): one batch padded every row to its longest pair's."""
    from kiln.posttrain.dpo import dpo_loss

    settings = job.settings()
    with autocast():
        logp = model_token_logps(policy, rollout.x, rollout.y)  # (N, T)
        ptx_logp = model_token_logps(policy, *ptx) if ptx is not None else None  # (M, T')
        # the replayed pairs' sums, their rows in groups of similar length (most are short, a few long)
        seq = model_sequence_logps(policy, preferences.x, preferences.y) if preferences is not None else None  # (2M,)
    if settings.ppo_epochs > 1 and rollout.old_logp is None:
        rollout.old_logp = logp.detach()  # the first update: the policy is still the one that sampled
    loss, stats = grpo_loss(logp, rollout.ref_logp, rollout.advantages, rollout.y != IGNORE, job.kl_coef,
                            old_logp=rollout.old_logp, eps_low=settings.eps_low, eps_high=settings.eps_high,
                            aggregation=settings.loss_aggregation, group_size=job.group_size)
    if ptx is not None:
        nll = -ptx_logp.sum() / (ptx[1] != IGNORE).sum().clamp(min=1)  # log-probs are 0 off the answers
        loss = loss + job.ptx_coef * nll
        stats["ptx_loss"] = float(nll.detach())
    if preferences is not None:
        m = preferences.x.size(0) // 2
        ref = preferences.ref_logp
        pref, chosen, rejected = dpo_loss(seq[:m], seq[m:], ref[:m], ref[m:], job.preference_beta)
        loss = loss + job.preference_coef * pref
        stats.update(preference_loss=float(pref.detach()),
                     preference_reward_accuracy=float((chosen > rejected).float().mean()))
    return loss, {**stats, **rollout.stats, "loss": float(loss.detach())}


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


class RlBatch(NamedTuple):
    """One micro-batch as RlStage.batches draws it."""

    items: list[dict]  # the prompts
    generator: torch.Generator  # draws the samples (one per sampled batch, used by its micro-batches in turn)
    refills: list[list[dict]]  # dynamic sampling's later rounds of prompts (none without it)
    key: tuple[int, int]  # (sampled batch, micro-batch): how the later updates of ppo_epochs > 1 find the samples
    ptx: list[dict]  # reference pairs for the supervised term (none without ptx_coef)
    preferences: list[dict]  # preference pairs replayed (none without preference_coef)


# statistics of the DAPO options and the added loss terms, in the history and the progress line when a run has them
OPTION_STATS = ("clip_frac", "groups_filtered", "sampling_rounds", "overlong_penalty", "ptx_loss", "preference_loss",
                "preference_reward_accuracy")


class RlStage(PosttrainStage):
    """Prompts drawn by (seed, sampled batch, rank), groups of sampled answers scored by an exact checker, the GRPO
    loss (or DAPO's, by the job's settings); the held-out measure is the greedy answers' exact reward."""

    def __init__(self, job: RlJob, info: DistInfo):
        from kiln.tokens.tokenizer import load_encoding

        kinds, self.exact_fn, _ = REWARDS[job.reward]
        self.reward_fn = make_reward(job.reward, job.partial_credit)
        self.settings = job.settings()
        self.enc = load_encoding(job.tokenizer)
        self.items = read_jsonl_split(job.train_files[0], "train", kinds)
        self.val_items = read_jsonl_split(job.train_files[0], "val", kinds)[: job.eval_items]
        self.pref_rows = read_jsonl_split(job.preference_file, "train") if job.preference_coef else []
        self.sampled_batch, self.rollouts = -1, {}  # the sampled batch whose rollouts are kept, by micro-batch
        super().__init__(job, info)

    def describe(self, trainer: Trainer) -> str:
        job, options = self.job, self.settings.describe()
        return (f"{job.algorithm.upper()} on {len(self.items)} {job.reward} prompts, {job.group_size} answers each, "
                f"kl_coef {job.kl_coef}{f'; {options}' if options else ''}"
                f"{f'; supervised term x{job.ptx_coef:g} on reference answers' if job.ptx_coef else ''}"
                f"{f'; DPO x{job.preference_coef:g} on {len(self.pref_rows)} replayed pairs' if job.preference_coef else ''}; "
                f"{len(self.val_items)} held out; "
                f"{self.info.world_size} x {self.info.device.type}, steps {trainer.run.step}->{job.max_steps}")

    def batches(self, index: int) -> Iterator[RlBatch]:
        # prompts and samples depend only on (seed, sampled batch, rank): a resumed run draws what the original would
        # have. With ppo_epochs > 1, that many steps share a sampled batch; a run resumed within one samples it again
        # (the same prompts and seed) with the resumed policy, as kiln.posttrain.ppo does
        job = self.job
        r = index // job.ppo_epochs
        rng = np.random.default_rng([job.seed, r, self.info.rank])
        gen = torch.Generator(device=self.info.device).manual_seed(int(rng.integers(2**62)))
        more = np.random.default_rng([job.seed, r, self.info.rank, 1])  # refills: a stream of their own
        sup = np.random.default_rng([job.seed, index, self.info.rank, 2])  # ptx pairs: one too, drawn every step
        prefs = np.random.default_rng([job.seed, index, self.info.rank, 3])  # and the replayed preference pairs
        size = min(job.micro_batch, len(self.items))
        for micro in range(job.grad_accum):
            picked = rng.choice(len(self.items), size=size, replace=False)
            refills = self.refills(more, picked) if self.settings.dynamic_sampling else []
            ptx = [self.items[i] for i in sup.choice(len(self.items), size=size, replace=False)] if job.ptx_coef else []
            replay = [self.pref_rows[i] for i in prefs.choice(len(self.pref_rows), size=min(job.micro_batch, len(
                self.pref_rows)), replace=False)] if job.preference_coef else []
            yield RlBatch([self.items[i] for i in picked], gen, refills, (r, micro), ptx, replay)

    def refills(self, rng: np.random.Generator, picked: np.ndarray) -> list[list[dict]]:
        """Dynamic sampling's later rounds for a micro-batch that drew ``picked``: micro_batch prompts each (fewer when
        the prompts run out), none drawn twice in the micro-batch."""
        rounds, used = [], picked
        for _ in range(self.settings.max_sampling_rounds - 1):
            pool = np.setdiff1d(np.arange(len(self.items)), used)
            if not len(pool):
                break
            more = rng.choice(pool, size=min(self.job.micro_batch, len(pool)), replace=False)
            rounds.append([self.items[i] for i in more])
            used = np.concatenate([used, more])
        return rounds

    def loss(self, trainer: Trainer, batch: RlBatch) -> tuple[torch.Tensor, dict[str, float]]:
        r, micro = batch.key
        if r != self.sampled_batch:  # a new sampled batch: the previous one's rollouts are done with
            self.sampled_batch, self.rollouts = r, {}
        rollout = self.rollouts.get(micro)
        if rollout is None:
            rollout = sample_rollout(trainer.raw, self.reference_logps, self.enc, batch.items, self.reward_fn, self.job,
                                     batch.generator, trainer.info.device, {"exact_answer": self.exact_fn},
                                     batch.refills)
            if self.job.ppo_epochs > 1:
                self.rollouts[micro] = rollout
        ptx = None
        if batch.ptx:
            x, y = encode_rows(self.enc, [p["prompt"] for p in batch.ptx], [p["response"] for p in batch.ptx],
                               self.job.seq_len)
            ptx = (x.to(trainer.info.device), y.to(trainer.info.device))
        return rollout_policy_loss(trainer.model, rollout, self.job, trainer.autocast, ptx,
                                   self.replayed(batch.preferences, trainer.info.device))

    def replayed(self, rows: list[dict], device: torch.device) -> Preferences | None:
        """Preference rows as the loss takes them, with their reference log-probs (None for no rows)."""
        from kiln.posttrain.dpo import encode_preferences, pair_batch

        if not rows:
            return None
        x, y = (t.to(device) for t in pair_batch(*encode_preferences(self.enc, rows, self.job.seq_len)))
        with torch.no_grad():
            ref = grouped_sequence_logps(self.reference_logps, x, y)  # (2M,)
        return Preferences(x, y, ref)

    def validate(self, trainer: Trainer) -> dict[str, float]:
        return {"val_reward": heldout_reward(trainer.raw, self.enc, self.val_items, self.exact_fn,
                                             self.job.max_new_tokens, self.info)}

    def history_row(self, step: int, train: dict[str, float], val: dict[str, float] | None) -> dict:
        return {"step": step, "reward": train["reward_mean"], "exact_answer": train["exact_answer"], "kl": train["kl"],
                "rollout_s": train["rollout_s"], "rollout_tokens_per_s": train["rollout_tokens_per_s"],
                **{k: train[k] for k in OPTION_STATS if k in train}, **(val or {})}

    def start_line(self, val: dict[str, float]) -> str:
        return f"step 0: held-out reward {val['val_reward']:.3f}"

    def progress(self, r: StepReport) -> str:
        t, m = r.train, r.metrics
        return (f"step {r.step}/{r.max_steps}: reward {t['reward_mean']:.3f} | exact {t['exact_answer']:.3f} | "
                f"kl {t['kl']:.4f} | groups with signal {t['groups_with_signal']:.2f} | answer tokens {t['answer_tokens']:.1f}"
                + (f" | clipped {t['clip_frac']:.3f}" if "clip_frac" in t else "")
                + (f" | {t['groups_filtered']:.1f} groups filtered in {t['sampling_rounds']:.1f} rounds"
                   if "groups_filtered" in t else "")
                + (f" | overlong penalty {t['overlong_penalty']:.3f}" if "overlong_penalty" in t else "")
                + (f" | ptx loss {t['ptx_loss']:.3f}" if "ptx_loss" in t else "")
                + (f" | replayed DPO loss {t['preference_loss']:.3f}" if "preference_loss" in t else "")
                + (f" | held-out reward {r.val['val_reward']:.3f}" if r.val else "")
                + (f" | rollout {t['rollout_s']:.2f} s, {t['rollout_tokens_per_s']:,.0f} tok/s"
                   f" of {m['step_time_s']:.2f} s" if "rollout_s" in t and "step_time_s" in m else "")
                + f" | {format_duration(r.left_s)} left")

    def summary(self, trainer: Trainer) -> dict[str, Any]:
        job = self.job
        vals = [h["val_reward"] for h in trainer.run.history if "val_reward" in h]
        return {**super().summary(trainer), "reward": job.reward, "group_size": job.group_size, "kl_coef": job.kl_coef,
                "algorithm": job.algorithm, "algorithm_settings": asdict(self.settings),
                "partial_credit": job.partial_credit, "ptx_coef": job.ptx_coef,
                "preference_coef": job.preference_coef, "prompts": {"train": len(self.items), "val": len(self.val_items)},
                "initial_val_reward": vals[0] if vals else None, "final_val_reward": vals[-1] if vals else None,
                "final_train": trainer.last_stats or None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampled_batch, self.rollouts = -1, {}  # restored weights: rollouts kept from other weights are not theirs


def main(argv: list[str] | None = None, reporter: Reporter | None = None, callbacks: Iterable = ()) -> dict[str, Any]:
    return run_job(RlJob, RlStage, __doc__, argv, reporter, callbacks)


if __name__ == "__main__":
    main(sys.argv[1:])
