"""Loss-spike detection for the training loop, and the rollback recipe PaLM used (Chowdhery et al. 2022, 5.1).

``SpikeDetector(SpikeConfig()).check(loss, grad_norm)`` says whether a step is a spike and why; on a loss spike
kiln.train.loop restores a checkpoint about ``rollback_steps`` earlier and skips ``skip_batches`` batches of data.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Annotated, Any

from kiln.common.config import Domain


@dataclass
class SpikeConfig:
    enabled: bool = True  # watch loss and gradient norm, and roll back on a spike
    warmup_steps: Annotated[int, Domain(0)] = 50  # first steps left out of the baseline (early loss falls too fast to be a yardstick)
    window: Annotated[int, Domain(5)] = 100  # most recent healthy steps after warmup the baseline statistics cover (at least 5 are needed)
    loss_zscore: Annotated[float, Domain(0, low_open=True)] = 6.0  # a loss this many standard deviations above the recent mean ...
    loss_rise: Annotated[float, Domain(0)] = 0.2  # ... and at least this fraction above it is a loss spike
    grad_ratio: Annotated[float, Domain(0)] = 10.0  # a gradient norm this many times its recent median is reported (the leading indicator; 0: off)
    rollback_on_grad: bool = False  # roll back on such a gradient norm too, not only on a loss spike
    rollback_steps: Annotated[int, Domain(0)] = 100  # restore the newest checkpoint at least this many steps before the spike
    skip_batches: Annotated[int, Domain(0)] = 200  # batches skipped from that checkpoint on (never fewer than were seen up to the spike)
    max_rollbacks: Annotated[int, Domain(0)] = 3  # after this many rollbacks the run fails instead of looping


MIN_BASELINE = 5  # healthy steps after warmup before any verdict


class SpikeError(RuntimeError):
    """Training kept spiking after ``max_rollbacks`` rollbacks; the message says what to try."""


class SpikeDetector:
    """Keeps recent healthy losses and gradient norms; a step far above them is a spike.

    Only healthy steps after warmup enter the window, so a spike never raises its own baseline and the fast
    early fall of the loss does not widen it. The state is saved in checkpoints, so a resumed run makes exactly
    the decisions an uninterrupted one would.
    """

    def __init__(self, cfg: SpikeConfig):
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.window)
        self.grads: deque[float] = deque(maxlen=cfg.window)
        self.seen = 0  # healthy steps observed so far

    def check(self, loss: float, grad_norm: float) -> tuple[str, str] | None:
        """(kind, why) for an unusual step, or None. Kind "loss" (or a non-finite value) calls for a rollback;
        kind "grad" is the leading indicator: reported, and a rollback only with ``rollback_on_grad``. Steps that are
        not rolled back join the baseline."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return "loss", f"non-finite loss {loss} or gradient norm {grad_norm}"
        verdict = None
        if self.cfg.enabled and len(self.losses) >= MIN_BASELINE:
            mean = sum(self.losses) / len(self.losses)
            std = math.sqrt(sum((x - mean) ** 2 for x in self.losses) / (len(self.losses) - 1))
            median = sorted(self.grads)[len(self.grads) // 2]
            if loss > mean + self.cfg.loss_zscore * std and loss > mean * (1 + self.cfg.loss_rise):
                verdict = "loss", f"loss {loss:.4f} is {(loss - mean) / max(std, 1e-12):.1f} std above its recent mean {mean:.4f}"
            elif self.cfg.grad_ratio > 0 and grad_norm > self.cfg.grad_ratio * median:
                verdict = "grad", f"gradient norm {grad_norm:.3g} is {grad_norm / median:.1f}x its recent median {median:.3g}"
        if verdict is None or not self.rolls_back(verdict):
            self.seen += 1
            if self.seen > self.cfg.warmup_steps:
                self.losses.append(loss)
                self.grads.append(grad_norm)
        return verdict

    def rolls_back(self, verdict: tuple[str, str] | None) -> bool:
        return verdict is not None and (verdict[0] == "loss" or self.cfg.rollback_on_grad)

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "grads": list(self.grads), "seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = deque(state["losses"], maxlen=self.cfg.window)
        self.grads = deque(state["grads"], maxlen=self.cfg.window)
        self.seen = int(state["seen"])
