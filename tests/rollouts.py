"""A GRPO/DAPO update in one call, for the tests: sample_rollout then rollout_policy_loss (the RL stage calls the two
apart, sampling with the unwrapped policy and updating through the wrapped one)."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from kiln.posttrain.rl import RewardFn, RlJob, rollout_policy_loss, sample_rollout


def rollout_loss(policy: torch.nn.Module, sampler: torch.nn.Module,
                 reference_logps: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 enc, items: list[dict], reward_fn: RewardFn, job: RlJob, generator: torch.Generator | None = None,
                 device: torch.device | str = "cpu", autocast=contextlib.nullcontext,
                 checks: dict[str, RewardFn] | None = None,
                 refills: list[list[dict]] = ()) -> tuple[torch.Tensor, dict[str, float]]:
    """Sample groups for ``items`` with ``sampler`` (the unwrapped policy), score them, and return the loss of one
    update computed through ``policy`` (which may be DDP-wrapped) with the reported statistics (``checks`` adds the
    mean of other scores of the same samples, e.g. the exact answer alone when the reward also counts format):
    sample_rollout, then rollout_policy_loss."""
    rollout = sample_rollout(sampler, reference_logps, enc, items, reward_fn, job, generator, device, checks, refills)
    return rollout_policy_loss(policy, rollout, job, autocast)
