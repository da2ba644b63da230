"""Tests of kiln/posttrain/preference_losses.py: each registered preference loss matches a hand computation."""

from __future__ import annotations

import math

import pytest
import torch


def test_each_preference_loss_matches_a_hand_computation() -> None:
    """Two pairs, by hand from each paper's formula (kiln.posttrain.preference_losses)."""
    from kiln.posttrain.preference_losses import LOSSES, LossSettings, PairLogps

    pc, pr = torch.tensor([-10.0, -12.0]), torch.tensor([-11.0, -9.0])  # summed policy log-probs
    rc, rr = torch.tensor([-10.5, -11.0]), torch.tensor([-10.0, -10.0])  # the reference's
    nc, nr = torch.tensor([4.0, 6.0]), torch.tensor([5.0, 3.0])  # response tokens
    pairs = PairLogps(pc, pr, rc, rr, nc, nr)
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731

    def want(name: str) -> list[float]:
        out = []
        for i in range(2):
            c, r = pc[i].item() - rc[i].item(), pr[i].item() - rr[i].item()
            if name == "dpo":  # -log sigmoid(beta (c - r)), beta 0.1
                out.append(-math.log(sig(0.1 * (c - r))))
            elif name == "ipo":  # (h - 1 / (2 tau))^2 on token-averaged log-ratios, tau 0.1
                out.append((c / nc[i].item() - r / nr[i].item() - 5.0) ** 2)
            elif name == "simpo":  # -log sigmoid(beta (avg_c - avg_r) - gamma), beta 2, gamma 1
                out.append(-math.log(sig(2.0 * (pc[i].item() / nc[i].item() - pr[i].item() / nr[i].item()) - 1.0)))
            else:  # kto: z0 = max(0, mean of the four log-ratios) = max(0, (0.5 - 1 - 1 + 1) / 4) = 0
                out.append(((1 - sig(0.1 * c)) + (1 - sig(-0.1 * r))) / 2)
        return out

    for name, entry in LOSSES.items():
        losses, chosen, rejected = entry.fn(pairs, LossSettings(beta=entry.beta))
        assert losses.tolist() == pytest.approx(want(name), rel=1e-6), name
    assert [LOSSES[n].beta for n in ("dpo", "ipo", "simpo", "kto")] == [0.1, 0.1, 2.0, 0.1]
    assert not LOSSES["simpo"].reference and all(LOSSES[n].reference for n in ("dpo", "ipo", "kto"))
    # KTO's reference point is positive when the policy has moved up on average: it then asks for more
    up = PairLogps(pc + 4, pr + 4, rc, rr, nc, nr)
    z0 = (torch.cat([up.chosen - rc, up.rejected - rr])).mean().item()
    got = LOSSES["kto"].fn(up, LossSettings(beta=0.1))[0][0].item()
    c0, r0 = up.chosen[0].item() - rc[0].item(), up.rejected[0].item() - rr[0].item()
    assert z0 > 0 and got == pytest.approx(((1 - sig(0.1 * (c0 - z0))) + (1 - sig(0.1 * (z0 - r0)))) / 2, rel=1e-6)


def test_every_loss_setting_is_a_dpo_job_field_and_settings_carries_them_all():
    import dataclasses

    from kiln.posttrain.dpo import DpoJob
    from kiln.posttrain.preference_losses import LOSS_FIELDS

    job_fields = {f.name for f in dataclasses.fields(DpoJob)}
    assert set(LOSS_FIELDS) <= job_fields, set(LOSS_FIELDS) - job_fields
    job = DpoJob(loss="kto", beta=0.3, kto_desirable_weight=1.5, kto_undesirable_weight=0.5)
    assert dataclasses.asdict(job.settings()) == {"beta": 0.3, "label_smoothing": 0.0, "simpo_gamma_ratio": 0.5,
                                                  "kto_desirable_weight": 1.5, "kto_undesirable_weight": 0.5}
    assert DpoJob(loss="simpo").settings().beta == 2.0  # 0: the paper's default
