"""Mixtures decided by small models (RegMix's approach): random mixtures of the source groups, each trained as a
proxy; a regression of held-out bits per byte on the mixture's shares, with its leave-one-out error beside that of
predicting the mean; and the predicted best mixture, the mean of the best-predicted of many candidate mixtures drawn
as the trained ones were (RegMix averages its top 100), so the prediction stays where the regression saw data.

``draw(["owt*", "wikipedia*", "web-samples"], n=10, seed=0)`` gives the mixtures; ``fit(shares, bpb)`` the
regression; ``best(fit, groups, seed)`` the mixture to verify. Nothing here imports Dagster.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln.common.config import ConfigError


def draw(groups: list[str], n: int, seed: int, alpha: float = 1.0) -> list[dict[str, float]]:
    """``n`` mixtures of ``groups``: shares drawn from a symmetric Dirichlet(``alpha``), rounded to 3 decimals
    (each mixture's shares sum to 1)."""
    if len(groups) < 2:
        raise ConfigError(f"mixture.groups: {groups}; a mixture needs at least two groups of sources")
    if len(set(groups)) != len(groups):
        raise ConfigError(f"mixture.groups: {groups} names a group twice")
    rng = np.random.default_rng(seed)
    out = []
    for w in rng.dirichlet([alpha] * len(groups), size=n):
        w = np.round(np.maximum(w, 0.001), 3)  # every group keeps a share (a weight of 0 would drop its sources)
        w[int(np.argmax(w))] += round(1.0 - float(w.sum()), 3)
        out.append({g: float(round(x, 3)) for g, x in zip(groups, w)})
    return out


def _design(shares: np.ndarray) -> np.ndarray:
    return np.hstack([np.ones((len(shares), 1)), shares])


def _solve(x: np.ndarray, y: np.ndarray, ridge: float) -> np.ndarray:
    penalty = ridge * np.eye(x.shape[1])
    penalty[0, 0] = 0.0  # the intercept is not shrunk
    return np.linalg.solve(x.T @ x + penalty, x.T @ y)


def fit(shares: list[dict[str, float]], bpb: list[float], ridge: float = 1e-3) -> dict[str, Any]:
    """Ridge regression of bits per byte on the groups' shares (linear, as RegMix's linear model): coefficients,
    R² on the fit, and its leave-one-out mean absolute error beside that of predicting the mean of the others
    (``loo_mae_mean``): the fit is worth using only where the first is clearly smaller."""
    if len(shares) != len(bpb) or len(shares) < 3:
        raise ConfigError(f"mixture: {len(shares)} trained mixtures; the regression needs at least 3 (raise samples)")
    groups = list(shares[0])
    s = np.array([[m[g] for g in groups] for m in shares], dtype=float)
    y = np.array(bpb, dtype=float)
    x = _design(s)
    coef = _solve(x, y, ridge)
    pred = x @ coef
    ss_tot = float(((y - y.mean()) ** 2).sum())
    loo, loo_mean = [], []
    for i in range(len(y)):
        keep = np.arange(len(y)) != i
        c = _solve(x[keep], y[keep], ridge)
        loo.append(abs(float(x[i] @ c) - y[i]))
        loo_mean.append(abs(float(y[keep].mean()) - y[i]))
    return {"groups": groups, "intercept": float(coef[0]), "coef": {g: float(c) for g, c in zip(groups, coef[1:])},
            "r2": 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan"),
            "loo_mae": float(np.mean(loo)), "loo_mae_mean": float(np.mean(loo_mean)), "n": len(y), "ridge": ridge,
            "residuals": [float(v) for v in y - pred]}


def predict(model: dict[str, Any], shares: dict[str, float]) -> float:
    return model["intercept"] + sum(model["coef"][g] * shares[g] for g in model["groups"])


def best(model: dict[str, Any], seed: int, alpha: float = 1.0, candidates: int = 100_000,
         top: int = 100) -> dict[str, Any]:
    """The predicted best mixture: the mean of the ``top`` candidates (of ``candidates`` drawn as the trained
    mixtures were) with the lowest predicted bits per byte, and its own prediction."""
    groups = model["groups"]
    rng = np.random.default_rng(seed)
    cand = rng.dirichlet([alpha] * len(groups), size=candidates)
    pred = model["intercept"] + cand @ np.array([model["coef"][g] for g in groups])
    chosen = cand[np.argsort(pred)[:top]].mean(axis=0)
    chosen = np.round(chosen / chosen.sum(), 3)
    chosen[int(np.argmax(chosen))] += round(1.0 - float(chosen.sum()), 3)
    shares = {g: float(round(x, 3)) for g, x in zip(groups, chosen)}
    return {"shares": shares, "predicted_bpb": predict(model, shares), "candidates": candidates, "top": top}
