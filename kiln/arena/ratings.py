"""Ratings from pairwise votes: Bradley-Terry (maximum likelihood) or online Elo, with seeded bootstrap intervals.

``ratings_table(names, comparisons, seed=0)`` gives one row per model (rating, 95% interval, votes, wins, losses,
ties); a comparison is (model a, model b, a's score: 1 a won, 0 b won, 0.5 a tie). Ratings are on the Elo scale
(400 * log10 of the strength, centred on 1000), so 100 points apart means the stronger wins 64% of the time.

Written by hand with numpy: choix (the one maintained Bradley-Terry package) is not in Kiln's pinned set, takes
whole wins only (ties as half a win need weights) and has no bootstrap; the MM update below is ten lines.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

SCALE = 400 / np.log(10)  # natural-log strength -> Elo points
BASE = 1000.0  # the mean rating
Z95 = 1.959964  # the normal quantile of a two-sided 95% interval
Comparison = tuple[str, str, float]  # (a, b, score of a: 1 win, 0 loss, 0.5 tie)


def win_matrix(n: int, a: np.ndarray, b: np.ndarray, score: np.ndarray) -> np.ndarray:
    """(n, n) W with W[i, j] = i's score against j summed over the comparisons (a tie gives each side 0.5)."""
    w = np.zeros((n, n))
    np.add.at(w, (a, b), score)
    np.add.at(w, (b, a), 1.0 - score)
    return w


def bradley_terry(w: np.ndarray, prior: float = 1.0, iters: int = 10_000, tol: float = 1e-10) -> np.ndarray:
    """Maximum-likelihood Bradley-Terry log-strengths (n,), centred on 0, from a win matrix W (n, n).

    ``prior`` adds that many virtual ties between every pair (half a win each way), so a model that won every vote
    still gets a finite rating and a graph of votes that is not connected still has one answer; 0 gives the plain
    MLE (which needs every model to have won and lost at least a share). Hunter's (2004) MM iteration:
    p_i <- W_i / sum_j n_ij / (p_i + p_j)."""
    n = w.shape[0]
    w = w + prior / 2 * (1 - np.eye(n))  # (n, n)
    games = w + w.T  # (n, n) comparisons per pair
    wins = w.sum(axis=1)  # (n,)
    p = np.ones(n)
    for _ in range(iters):
        denom = (games / (p[:, None] + p[None, :])).sum(axis=1)  # (n,)
        new = np.maximum(wins / denom, 1e-12)  # a model that never won (prior 0) tends to 0: keep its log finite
        new /= np.exp(np.log(new).mean())  # geometric mean 1: the scale is fixed, the MLE is not
        if np.max(np.abs(new - p)) < tol:
            p = new
            break
        p = new
    return np.log(p)


def bt_standard_errors(w: np.ndarray, log_strength: np.ndarray, prior: float = 1.0) -> np.ndarray:
    """Standard errors (n,) of Bradley-Terry log-strengths from the observed information of the likelihood with the
    ``prior`` virtual ties (its inverse taken on the centred parametrisation: a pseudo-inverse, since adding a
    constant to every strength changes nothing)."""
    n = w.shape[0]
    games = w + w.T + prior * (1 - np.eye(n))  # (n, n) comparisons per pair, the virtual ties included
    p = np.exp(log_strength)
    win = p[:, None] / (p[:, None] + p[None, :])  # (n, n) P(i beats j)
    v = games * win * win.T  # (n, n) each pair's information
    info = np.diag(v.sum(axis=1)) - v
    return np.sqrt(np.clip(np.diag(np.linalg.pinv(info)), 0.0, None))


def elo(n: int, a: np.ndarray, b: np.ndarray, score: np.ndarray, k: float = 32.0) -> np.ndarray:
    """Online Elo over the comparisons in order, starting from 0; returns ratings (n,) in Elo points, centred."""
    r = np.zeros(n)
    for i, j, s in zip(a, b, score):
        expected = 1.0 / (1.0 + 10 ** ((r[j] - r[i]) / 400))
        r[i] += k * (s - expected)
        r[j] -= k * (s - expected)
    return r - r.mean()


def _points(method: str, n: int, a: np.ndarray, b: np.ndarray, s: np.ndarray, prior: float) -> np.ndarray:
    """Ratings (n,) in Elo points around 0 by ``method`` (bt or elo)."""
    if method == "bt":
        return SCALE * bradley_terry(win_matrix(n, a, b, s), prior)
    if method == "elo":
        return elo(n, a, b, s)
    raise ValueError(f"ratings: unknown method {method!r}; choose bt (Bradley-Terry) or elo")


def bootstrap(method: str, n: int, a: np.ndarray, b: np.ndarray, s: np.ndarray, rounds: int = 200, seed: int = 0,
              prior: float = 1.0, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) (n,) each: the ``level`` percentile interval of each rating over ``rounds`` resamplings of the
    votes with replacement (Elo also replays them in the resampled order), from a generator seeded by ``seed``."""
    rng = np.random.default_rng(seed)
    draws = np.empty((rounds, n))
    for r in range(rounds):
        pick = rng.integers(0, len(a), len(a))  # (V,) votes drawn with replacement
        draws[r] = _points(method, n, a[pick], b[pick], s[pick], prior)
    tail = (1 - level) / 2 * 100
    return np.percentile(draws, tail, axis=0), np.percentile(draws, 100 - tail, axis=0)


def ratings_table(names: Sequence[str], comparisons: Sequence[Comparison], method: str = "bt", seed: int = 0,
                  rounds: int = 200, prior: float = 1.0) -> list[dict]:
    """One row per model, best first: model, rating, low and high (the 95% bootstrap interval, widened to hold the
    rating where the resampled ratings all fall on one side of it; the Bradley-Terry Wald interval where the bootstrap
    has no spread: no votes, or every vote one way), votes, wins, losses, ties. Unknown names in ``comparisons`` are
    errors."""
    index = {m: i for i, m in enumerate(names)}
    unknown = sorted({m for c in comparisons for m in c[:2]} - set(index))
    if unknown:
        raise ValueError(f"ratings: comparisons name model(s) {unknown} that are not among {list(names)}")
    n = len(names)
    a = np.array([index[c[0]] for c in comparisons], dtype=int)
    b = np.array([index[c[1]] for c in comparisons], dtype=int)
    s = np.array([float(c[2]) for c in comparisons])
    est = _points(method, n, a, b, s, prior)
    lo, hi = bootstrap(method, n, a, b, s, rounds, seed, prior) if len(a) else (est.copy(), est.copy())
    # no votes, or votes whose every resampling is the same (all one way): the bootstrap has no spread to show, so
    # such a rating gets its 95% Wald interval under Bradley-Terry with the prior, never a zero-width one
    flat = hi - lo < 1e-6
    if flat.any():
        se = SCALE * bt_standard_errors(win_matrix(n, a, b, s), _points("bt", n, a, b, s, prior) / SCALE, prior)
        lo[flat], hi[flat] = est[flat] - Z95 * se[flat], est[flat] + Z95 * se[flat]
    rows = []
    for m, i in index.items():
        mine = (a == i) | (b == i)  # (V,) the votes this model was in
        won = ((a == i) & (s == 1)) | ((b == i) & (s == 0))
        n_votes, n_wins, n_ties = int(mine.sum()), int(won.sum()), int((mine & (s == 0.5)).sum())
        rows.append({"model": m, "rating": round(float(BASE + est[i]), 1),
                     "low": round(float(BASE + min(lo[i], est[i])), 1), "high": round(float(BASE + max(hi[i], est[i])), 1),
                     "votes": n_votes, "wins": n_wins, "losses": n_votes - n_wins - n_ties, "ties": n_ties})
    return sorted(rows, key=lambda r: -r["rating"])
