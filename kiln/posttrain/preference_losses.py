"""Preference-optimisation losses by name: what the DPO stage (kiln.posttrain.dpo, ``loss``) minimises over pairs.

Each entry is one function from the pairs' response log-probabilities to per-pair losses and implicit rewards, with
the paper's default beta. Adding a loss is one function plus one line in LOSSES. Written here rather than taken
from TRL for the reason kiln.posttrain.dpo gives (TRL's trainers need Hugging Face models and datasets); the formulas
follow the papers, with TRL's choices named where a paper leaves one open.

- ``dpo`` (Rafailov et al. 2023): -log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r))), beta 0.1; with label
  smoothing eps (conservative DPO), (1 - eps) of that plus eps of the flipped pair's loss.
- ``ipo`` (Azar et al. 2023, eq. 17): (h - 1 / (2 tau))^2 with h = (pi_c - ref_c) - (pi_r - ref_r) on log-probs
  averaged over each response's tokens (as TRL computes IPO), tau (``beta``) 0.1.
- ``simpo`` (Meng et al. 2024): no reference model; rewards beta x the average log-prob of a response, loss
  -log sigmoid(r_c - r_r - gamma) with gamma = ``simpo_gamma_ratio`` x beta; beta 2.0 and gamma / beta 0.5, the
  paper's recommended setting.
- ``kto`` (Ethayarajh et al. 2024): each chosen response a desirable example, each rejected one an undesirable
  example (the pairing is not used): lambda_D (1 - sigmoid(beta (r_c - z0))) and lambda_U (1 - sigmoid(beta (z0 - r_r)))
  with r = pi - ref, averaged over the examples; beta 0.1, lambda_D = lambda_U = 1 (equal counts). z0, the KL
  reference point, is max(0, mean r over the batch's responses), detached: an estimate from the batch's own
  responses where the paper pairs each prompt with another example's response (which needs another forward pass).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass
class PairLogps:
    """Summed response log-probabilities of B pairs under the policy and the reference (None when the loss has no
    reference), and each response's token count (for length-normalised losses)."""

    chosen: torch.Tensor  # (B,)
    rejected: torch.Tensor  # (B,)
    ref_chosen: torch.Tensor | None  # (B,)
    ref_rejected: torch.Tensor | None  # (B,)
    chosen_tokens: torch.Tensor  # (B,)
    rejected_tokens: torch.Tensor  # (B,)


@dataclass(frozen=True)
class LossSettings:
    beta: float
    label_smoothing: float = 0.0
    simpo_gamma_ratio: float = 0.5
    kto_desirable_weight: float = 1.0
    kto_undesirable_weight: float = 1.0


# a loss hyper-parameter is a LossSettings field, a kiln.posttrain.dpo.DpoJob field of the same name (its default,
# domain and comment: what the launchpad shows) and its use in the loss; the job's settings() and the dpo_model asset's
# fields follow from this list
LOSS_FIELDS = tuple(f.name for f in dataclasses.fields(LossSettings))

Result = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # per-pair losses (B,), chosen and rejected rewards (B,)


def dpo(p: PairLogps, s: LossSettings) -> Result:
    chosen, rejected = s.beta * (p.chosen - p.ref_chosen), s.beta * (p.rejected - p.ref_rejected)
    margin = chosen - rejected
    losses = -(1 - s.label_smoothing) * F.logsigmoid(margin) - s.label_smoothing * F.logsigmoid(-margin)
    return losses, chosen, rejected


def ipo(p: PairLogps, s: LossSettings) -> Result:
    c = (p.chosen - p.ref_chosen) / p.chosen_tokens
    r = (p.rejected - p.ref_rejected) / p.rejected_tokens
    return (c - r - 1 / (2 * s.beta)) ** 2, s.beta * c, s.beta * r


def simpo(p: PairLogps, s: LossSettings) -> Result:
    chosen, rejected = s.beta * p.chosen / p.chosen_tokens, s.beta * p.rejected / p.rejected_tokens
    return -F.logsigmoid(chosen - rejected - s.simpo_gamma_ratio * s.beta), chosen, rejected


def kto(p: PairLogps, s: LossSettings) -> Result:
    c, r = p.chosen - p.ref_chosen, p.rejected - p.ref_rejected
    z0 = torch.cat([c, r]).mean().clamp(min=0).detach()  # the KL reference point (see the module docstring)
    desirable = s.kto_desirable_weight * (1 - torch.sigmoid(s.beta * (c - z0)))
    undesirable = s.kto_undesirable_weight * (1 - torch.sigmoid(s.beta * (z0 - r)))
    return (desirable + undesirable) / 2, s.beta * c, s.beta * r  # the mean over 2B examples, pair by pair


@dataclass(frozen=True)
class PreferenceLoss:
    fn: Callable[[PairLogps, LossSettings], Result]
    beta: float  # the paper's default
    reference: bool  # whether it compares the policy with the frozen reference model
    paper: str


LOSSES: dict[str, PreferenceLoss] = {
    "dpo": PreferenceLoss(dpo, 0.1, True, "Rafailov et al. 2023"),
    "ipo": PreferenceLoss(ipo, 0.1, True, "Azar et al. 2023"),
    "simpo": PreferenceLoss(simpo, 2.0, False, "Meng et al. 2024"),
    "kto": PreferenceLoss(kto, 0.1, True, "Ethayarajh et al. 2024"),
}


def preference_loss(name: str, where: str = "dpo_model") -> PreferenceLoss:
    """The loss registered as ``name``; an unknown name is an error listing the known ones."""
    from kiln.common.config import ConfigError

    if name not in LOSSES:
        raise ConfigError(f"{where}.loss: {name!r} is not a preference loss; choose one of {', '.join(LOSSES)}")
    return LOSSES[name]
