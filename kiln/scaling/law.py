"""Chinchilla scaling-law fits for a ladder of small runs: IsoFLOP profiles (approach 2) and the parametric law
L(N, D) = E + A / N^alpha + B / D^beta (approach 3) of Hoffmann et al. 2022, "Training Compute-Optimal Large Language
Models".

In code: ``fit_isoflop(points)`` gives N_opt(C) = k_N C^a and D_opt(C) = k_D C^b; ``fit_parametric(points)`` gives a
``LawFit`` with seeded bootstrap intervals, ``.predict(N, D)``, ``.interval(N, D)`` and ``.optimal(C)``. A point is a
``ScalingPoint`` or a dict {"params": N, "tokens": D, "flops": C, "loss": final validation loss, "name": optional}, where
C is the budget the run was planned for: points group into IsoFLOP profiles by exact equality of ``flops``.

Written by hand on numpy and scipy: the one PyPI package for this (``chinchilla`` 0.2.0, a research toolkit last
released 2025-01) is outside Kiln's pinned set, and the paper's objective (a Huber loss on log-loss residuals, minimised
by L-BFGS from a grid of starts) is a few dozen lines with an analytic gradient.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np
from scipy.optimize import minimize, minimize_scalar

try:  # installed with scikit-learn (lm-eval's); without it the fit is as fast, only hungrier
    from threadpoolctl import threadpool_limits
except ImportError:  # pragma: no cover
    def threadpool_limits(limits: int | None = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

# The paper's approach 3 fit (its eq. 10; loss in nats on MassiveText with its tokenizer). Compare exponents with it;
# E, A and B move with the data and the tokenizer, so a different value there is no fault.
CHINCHILLA = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}
COEFFICIENTS = ("E", "A", "B", "alpha", "beta")
LEVEL = (2.5, 97.5)  # percentiles of every bootstrap interval: a two-sided 95% interval
GRID_STARTS = 16  # L-BFGS runs in the main fit, from the best-scoring points of the paper's grid
BOOTSTRAP_GRID_STARTS = 2  # grid starts per bootstrap refit, after the main fit's own coefficients
GRAD_TOL = 1e-3  # the most |gradient| a converged fit may keep, in the units of _objective (residuals over delta)
FTOL = 1e-12  # L-BFGS-B's relative reduction of the objective at which it stops
# Box for L-BFGS-B in the centred coordinates it works in (a' = log of the N term at the mean size, b' likewise, e =
# log E, the exponents): wide of any law a ladder fits (a', b', e are logs of parts of a loss of a few nats), and
# narrow enough that a run the points cannot pin down stops at a bound, marked unconverged, instead of walking
# log A past what a float holds (exp overflows beyond 709). The one bound that is no failure is e's floor: E of
# about 0 (4.5e-5) is a law whose points show no irreducible loss yet.
BOUNDS = [(-30.0, 30.0), (-30.0, 30.0), (-10.0, 6.0), (0.0, 3.0), (0.0, 3.0)]
POINT_KEYS = ("params", "tokens", "flops", "loss")


class FitError(ValueError):
    """The points cannot give the fit asked for: too few, degenerate, or an optimisation that did not converge."""


@dataclass(frozen=True)
class ScalingPoint:
    """One finished run of a ladder."""

    params: float  # N: the model's parameters
    tokens: float  # D: training tokens seen
    flops: float  # C: the compute budget the run was planned for; its IsoFLOP group (not 6ND recomputed)
    loss: float  # final validation loss (nats per token)
    name: str = ""  # the run's name, for messages and tables

    def describe(self) -> str:
        label = f"{self.name} " if self.name else ""
        return f"{label}(N={self.params:.4g}, D={self.tokens:.4g}, C={self.flops:.4g}, loss={self.loss:.5g})"


def as_point(point: ScalingPoint | Mapping[str, Any] | Any, index: int = 0) -> ScalingPoint:
    """A ``ScalingPoint`` from a dict or any object with ``params``, ``tokens``, ``flops`` and ``loss`` attributes.

    A dict with a key other than those and ``name`` is an error: a misspelt key (``parameters``, or ``budget`` expecting
    it to group the points) would otherwise be dropped without a word."""
    if isinstance(point, ScalingPoint):
        p = point
    elif isinstance(point, Mapping):
        unknown = sorted(set(point) - set(POINT_KEYS) - {"name"})
        missing = [k for k in POINT_KEYS if k not in point]
        if unknown or missing:
            raise FitError(f"scaling point {index} ({dict(point)}): "
                           + (f"unknown key(s) {unknown}; " if unknown else "")
                           + (f"missing key(s) {missing}; " if missing else "")
                           + f"a point has keys {list(POINT_KEYS)} and optionally 'name'")
        p = ScalingPoint(*(float(point[k]) for k in POINT_KEYS), name=str(point.get("name") or ""))
    else:
        missing = [k for k in POINT_KEYS if not hasattr(point, k)]
        if missing:
            raise FitError(f"scaling point {index} ({point!r}) has no attribute(s) {missing}; "
                           f"pass a dict or an object with {list(POINT_KEYS)}")
        p = ScalingPoint(*(float(getattr(point, k)) for k in POINT_KEYS), name=str(getattr(point, "name", "") or ""))
    bad = [k for k in POINT_KEYS if not (math.isfinite(getattr(p, k)) and getattr(p, k) > 0)]
    if bad:
        raise FitError(f"scaling point {index} {p.describe()}: {bad} must be positive and finite (the fits take logs)")
    return p


def as_points(points: Iterable[Any]) -> list[ScalingPoint]:
    return [as_point(p, i) for i, p in enumerate(points)]


def _listing(points: Iterable[ScalingPoint], most: int = 40) -> str:
    """The points one per line, for an error message (the first ``most``)."""
    points = list(points)
    lines = [f"  {p.describe()}" for p in points[:most]]
    if len(points) > most:
        lines.append(f"  ... and {len(points) - most} more")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Approach 2: IsoFLOP profiles


@dataclass
class BudgetProfile:
    """One IsoFLOP budget: its points, the parabola's minimum, and whether it may enter the power-law fit."""

    flops: float  # C
    points: list[ScalingPoint]
    usable: bool
    why: str = ""  # why not usable; empty when usable
    params_opt: float | None = None  # N at the parabola's vertex (None when not usable)
    tokens_opt: float | None = None  # D there, interpolated in log D against log N among the budget's points
    loss_opt: float | None = None  # the parabola's loss at its vertex

    def to_dict(self) -> dict[str, Any]:
        return {"flops": self.flops, "usable": self.usable, "why": self.why, "params_opt": self.params_opt,
                "tokens_opt": self.tokens_opt, "loss_opt": self.loss_opt,
                "points": [dataclasses.asdict(p) for p in self.points]}


@dataclass
class IsoFlopFit:
    """N_opt(C) = k_N C^a and D_opt(C) = k_D C^b, fitted by least squares on logs over the usable budgets."""

    budgets: list[BudgetProfile]  # every budget, usable or not, smallest C first
    a: float  # exponent of N_opt in C (the paper's approach 2: 0.49)
    b: float  # exponent of D_opt in C (the paper's approach 2: 0.51)
    k_params: float  # k_N
    k_tokens: float  # k_D

    def params_for(self, flops: float) -> float:
        """The compute-optimal parameter count N_opt for a budget of ``flops``."""
        return self.k_params * flops ** self.a

    def tokens_for(self, flops: float) -> float:
        """The compute-optimal token count D_opt for a budget of ``flops``."""
        return self.k_tokens * flops ** self.b

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "k_params": self.k_params, "k_tokens": self.k_tokens,
                "budgets_used": sum(b.usable for b in self.budgets), "budgets": [b.to_dict() for b in self.budgets]}


def _profile(flops: float, points: list[ScalingPoint]) -> BudgetProfile:
    """Fit one budget's parabola of loss against log N and judge whether its vertex can be used."""
    x = np.log([p.params for p in points])
    sizes = np.unique(x)
    if len(sizes) < 3:
        return BudgetProfile(flops, points, False, f"fewer than 3 distinct sizes ({len(sizes)}): a parabola needs 3; "
                                                   "add sizes to this budget")
    centre = x.mean()  # fit in x - centre: the same parabola, better conditioned than raw log N of about 20
    c2, c1, c0 = np.polyfit(x - centre, [p.loss for p in points], 2)
    lo, hi = math.exp(sizes[0]), math.exp(sizes[-1])
    if c2 <= 0:
        return BudgetProfile(flops, points, False, f"the parabola opens downward (curvature {c2:.3g}): it has no "
                                                   f"minimum among the sizes tried ({lo:.3g}..{hi:.3g}); add sizes on "
                                                   "both sides of the best one")
    u = -c1 / (2 * c2)
    vertex = u + centre
    if not sizes[0] <= vertex <= sizes[-1]:
        return BudgetProfile(flops, points, False, "minimum at the edge: the budget's optimum is outside the sizes "
                                                   f"tried (the parabola's vertex is at N={math.exp(vertex):.3g}, sizes "
                                                   f"tried {lo:.3g}..{hi:.3g}); add sizes beyond it")
    # D at the vertex: log D interpolated against log N between the two sizes either side (mean log D per size). No FLOP
    # model is needed; with D = C / f(N) it is exact when f is a power of N (6N) and within the curvature of log f
    # between neighbouring sizes otherwise
    log_d = np.array([np.mean([math.log(p.tokens) for p, xi in zip(points, x) if xi == s]) for s in sizes])
    tokens = math.exp(float(np.interp(vertex, sizes, log_d)))
    return BudgetProfile(flops, points, True, "", math.exp(vertex), tokens, float(c0 + c1 * u + c2 * u * u))


def fit_isoflop(points: Iterable[Any]) -> IsoFlopFit:
    """Approach 2: per budget, the vertex of a parabola of loss in log N gives N_opt(C) and D_opt(C); then power laws
    in C through the usable budgets. Budgets with fewer than 3 sizes, a parabola that opens downward, or a vertex
    outside the sizes tried are reported in ``budgets`` and left out. Fewer than 2 usable budgets is a ``FitError``."""
    pts = as_points(points)
    groups: dict[float, list[ScalingPoint]] = {}
    for p in pts:
        groups.setdefault(p.flops, []).append(p)
    budgets = [_profile(c, sorted(groups[c], key=lambda p: p.params)) for c in sorted(groups)]
    usable = [b for b in budgets if b.usable]
    if len(usable) < 2:
        lines = [f"  C={b.flops:.4g} ({len(b.points)} points): {b.why or 'usable'}" for b in budgets]
        raise FitError(f"fit_isoflop needs at least 2 usable budgets (points grouped by equal 'flops', each with >= 3 "
                       f"sizes around its minimum), got {len(usable)} of {len(budgets)}:\n" + "\n".join(lines))
    log_c = np.log([b.flops for b in usable])
    a, log_kn = np.polyfit(log_c, np.log([b.params_opt for b in usable]), 1)
    b, log_kd = np.polyfit(log_c, np.log([b.tokens_opt for b in usable]), 1)
    return IsoFlopFit(budgets, float(a), float(b), math.exp(log_kn), math.exp(log_kd))


# ---------------------------------------------------------------------------------------------------------------------
# Approach 3: the parametric law, L(N, D) = E + A / N^alpha + B / D^beta


def _objective(theta: np.ndarray, x: np.ndarray, y: np.ndarray, log_loss: np.ndarray,
               delta: float) -> tuple[float, np.ndarray]:
    """The paper's objective and its gradient: sum_i Huber_delta(LSE(a - alpha x_i, b - beta y_i, e) - log L_i), divided
    by delta (the same minimiser; undivided, the sum is of order 1e-4 and L-BFGS-B's reduction test, absolute below 1,
    would stop it early).

    theta = (a, b, e, alpha, beta) with a = log A, b = log B, e = log E; x = log N and y = log D, each (n,)."""
    a, b, e, alpha, beta = theta
    t = np.empty((3, x.size))  # (3, n) the three terms; filled in place, this runs some 50,000 times a fit
    np.multiply(x, -alpha, out=t[0])
    t[0] += a
    np.multiply(y, -beta, out=t[1])
    t[1] += b
    t[2] = e
    m = t.max(axis=0)  # (n,) the log-sum-exp shift
    t -= m
    np.exp(t, out=t)
    s = t.sum(axis=0)  # (n,)
    r = np.log(s) + m - log_loss  # (n,) residual in log loss
    t /= s  # (3, n) softmax: d LSE / d term
    psi = np.clip(r / delta, -1.0, 1.0)  # (n,) Huber's derivative, over delta
    # Huber over delta is r^2 / (2 delta) inside [-delta, delta] and |r| - delta / 2 outside: psi r - delta psi^2 / 2
    f = float(psi @ r - 0.5 * delta * (psi @ psi))
    g = t @ psi  # (3,)
    return f, np.array([g[0], g[1], g[2], -(psi * t[0]) @ x, -(psi * t[1]) @ y])


def _grid() -> np.ndarray:
    """The paper's initialisation grid, (4500, 5) rows of (a, b, e, alpha, beta): alpha, beta in {0, 0.5, .., 2},
    e in {-1, -0.5, .., 1}, a, b in {0, 5, .., 25}."""
    ab = np.arange(0.0, 26.0, 5.0)
    rows = itertools.product(ab, ab, np.arange(-1.0, 1.01, 0.5), np.arange(0.0, 2.01, 0.5), np.arange(0.0, 2.01, 0.5))
    return np.array(list(rows))


def _grid_scores(grid: np.ndarray, x: np.ndarray, y: np.ndarray, log_loss: np.ndarray, delta: float) -> np.ndarray:
    """``_objective`` at every grid row at once, (G,)."""
    t1 = grid[:, 0:1] - grid[:, 3:4] * x  # (G, n)
    t2 = grid[:, 1:2] - grid[:, 4:5] * y  # (G, n)
    r = np.logaddexp(np.logaddexp(t1, t2), grid[:, 2:3]) - log_loss  # (G, n)
    absr = np.abs(r)
    return np.where(absr <= delta, 0.5 * r * r, delta * (absr - 0.5 * delta)).sum(axis=1) / delta


@dataclass
class _Run:
    theta: np.ndarray  # (a, b, e, alpha, beta), uncentred
    fun: float  # _objective there
    grad: float  # max |gradient| there (centred coordinates)
    success: bool
    message: str

    @property
    def ok(self) -> bool:
        return self.success and self.grad <= GRAD_TOL


def _minimise(x: np.ndarray, y: np.ndarray, log_loss: np.ndarray, delta: float, starts: np.ndarray) -> _Run:
    """L-BFGS-B from each start; the run with the least objective (a converged one when it ties the least).

    The optimisation runs in centred coordinates, a' = a - alpha mean(x) and b' = b - beta mean(y): the same law and
    minimiser, but a and alpha are no longer tied together by log N of about 20 (a fifth to a third fewer evaluations
    on the test ladders)."""
    xm, ym = float(x.mean()), float(y.mean())
    runs = []
    for start in starts:
        s = np.array(start, dtype=float)
        s[0] -= s[3] * xm
        s[1] -= s[4] * ym
        res = minimize(_objective, s, args=(x - xm, y - ym, log_loss, delta), jac=True, method="L-BFGS-B",
                       bounds=BOUNDS, options={"ftol": FTOL, "gtol": 1e-10, "maxiter": 2000})
        theta = np.array(res.x, dtype=float)
        theta[0] += theta[3] * xm
        theta[1] += theta[4] * ym
        at_bound = [name for name, v, (lo, hi) in zip(("a", "b", "e", "alpha", "beta"), res.x, BOUNDS)
                    if min(v - lo, hi - v) < 1e-6 and not (name == "e" and v - lo < 1e-6)]  # E ~ 0 is a law
        message = str(res.message) + (f"; stopped at the bound of {', '.join(at_bound)}" if at_bound else "")
        runs.append(_Run(theta, float(res.fun), float(np.abs(res.jac).max()), bool(res.success) and not at_bound,
                         message))
    best = min(runs, key=lambda r: r.fun)
    if not best.ok:  # a line search that gave up at the same minimum as a run that converged is no failure
        tied = [r for r in runs if r.ok and r.fun <= best.fun + 1e-9 * max(1.0, abs(best.fun))]
        best = tied[0] if tied else best
    return best


def _law(theta: np.ndarray, params: Any, tokens: Any) -> Any:
    """L(N, D) for parameter rows theta (..., 5) of (E, A, B, alpha, beta); broadcasts."""
    theta = np.asarray(theta, dtype=float)
    E, A, B, alpha, beta = (theta[..., i] for i in range(5))
    return E + A / np.power(params, alpha) + B / np.power(tokens, beta)


@dataclass
class LawFit:
    """L(N, D) = E + A / N^alpha + B / D^beta fitted to a ladder's points, with bootstrap intervals."""

    E: float  # irreducible loss
    A: float
    B: float
    alpha: float  # exponent of N
    beta: float  # exponent of D
    points: tuple[ScalingPoint, ...]  # the points fitted
    delta: float  # Huber's delta, in log loss
    objective: float  # sum of Huber_delta(log residual) at the fit, the paper's units
    converged: bool  # L-BFGS-B reported success and left |gradient| <= GRAD_TOL
    why: str = ""  # why not converged; empty when converged
    gradient: float = 0.0  # max |gradient| of the objective (over delta) at the fit
    starts: int = 0  # L-BFGS-B runs in the main fit
    bootstrap: int = 0  # resamples asked for
    bootstrap_used: int = 0  # resamples whose refit converged and entered the intervals
    bootstrap_skipped: dict[str, int] = field(default_factory=dict)  # reason -> resamples left out
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)  # coefficient -> (2.5%, 97.5%)
    draws: np.ndarray = field(default_factory=lambda: np.empty((0, 5)), repr=False)  # (bootstrap_used, 5) coefficients

    @property
    def coefficients(self) -> dict[str, float]:
        return {"E": self.E, "A": self.A, "B": self.B, "alpha": self.alpha, "beta": self.beta}

    def check(self) -> LawFit:
        """This fit, or a ``FitError`` when the optimisation did not converge (for callers that act on the numbers)."""
        if not self.converged:
            raise FitError(f"fit_parametric did not converge: {self.why}\npoints:\n{_listing(self.points)}")
        return self

    def predict(self, params: float, tokens: float) -> float:
        """The law's loss for a model of ``params`` parameters trained on ``tokens`` tokens."""
        return float(_law([self.E, self.A, self.B, self.alpha, self.beta], params, tokens))

    def interval(self, params: float, tokens: float) -> tuple[float, float]:
        """The 2.5 and 97.5 percentiles of the bootstrap fits' predictions at (params, tokens)."""
        if not len(self.draws):
            raise FitError(f"LawFit.interval: no bootstrap fits to take an interval from ({self.bootstrap} asked, "
                           f"skipped {self.bootstrap_skipped or 'none'}); refit with fit_parametric(..., bootstrap=200)")
        low, high = np.percentile(_law(self.draws, params, tokens), LEVEL)
        return float(low), float(high)

    def optimal(self, flops: float, flops_per_token: Callable[[float], float] | None = None,
                bounds: tuple[float, float] = (1e3, 1e13)) -> tuple[float, float]:
        """(N_opt, D_opt) that minimise the law's loss for a budget of ``flops``.

        With ``flops_per_token`` None, the paper's closed form for C = 6ND (its eq. 4). With a callable f(N) giving
        training FLOPs per token of a model of N parameters (attention included, say), L(N, C / f(N)) is minimised
        over log N within ``bounds``; an optimum at a bound is a ``FitError`` (pass wider bounds)."""
        if self.alpha <= 0 or self.beta <= 0:
            raise FitError(f"LawFit.optimal: the fit has alpha={self.alpha:.4g}, beta={self.beta:.4g}; the loss does "
                           "not fall with both N and D, so no size is compute-optimal. Check the fit (LawFit.check, "
                           "residuals) or use fit_isoflop")
        if flops_per_token is None:
            g = (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))
            params = g * (flops / 6) ** (self.beta / (self.alpha + self.beta))
            return float(params), float(flops / 6 / params)
        lo, hi = math.log(bounds[0]), math.log(bounds[1])

        def loss_at(log_n: float) -> float:
            n = math.exp(log_n)
            return self.predict(n, flops / flops_per_token(n))

        res = minimize_scalar(loss_at, bounds=(lo, hi), method="bounded", options={"xatol": 1e-10})
        if min(res.x - lo, hi - res.x) < 1e-4 * (hi - lo):
            raise FitError(f"LawFit.optimal: the best N for C={flops:.4g} lies at the bound N={math.exp(res.x):.4g} "
                           f"of bounds={bounds}; pass wider bounds")
        params = math.exp(res.x)
        return params, flops / flops_per_token(params)

    def residuals(self) -> list[dict[str, Any]]:
        """Per point: its loss, the law's, and the relative error (law - loss) / loss."""
        rows = []
        for p in self.points:
            pred = self.predict(p.params, p.tokens)
            rows.append({"name": p.name, "params": p.params, "tokens": p.tokens, "flops": p.flops, "loss": p.loss,
                         "predicted": pred, "relative_error": (pred - p.loss) / p.loss})
        return rows

    def to_dict(self) -> dict[str, Any]:
        """Metadata: coefficients, their intervals, how the fit went, and the residual on each point."""
        return {**self.coefficients, "intervals": {k: list(v) for k, v in self.intervals.items()},
                "points": len(self.points), "delta": self.delta, "objective": self.objective,
                "converged": self.converged, "why": self.why, "gradient": self.gradient, "starts": self.starts,
                "bootstrap": self.bootstrap, "bootstrap_used": self.bootstrap_used,
                "bootstrap_skipped": dict(self.bootstrap_skipped), "residuals": self.residuals()}


def _coefficients(theta: np.ndarray) -> np.ndarray:
    """(E, A, B, alpha, beta) from (a, b, e, alpha, beta)."""
    a, b, e, alpha, beta = theta
    return np.array([math.exp(e), math.exp(a), math.exp(b), alpha, beta])


def _bootstrap(x: np.ndarray, y: np.ndarray, log_loss: np.ndarray, delta: float, starts: np.ndarray, rounds: int,
               seed: int) -> tuple[np.ndarray, dict[str, int]]:
    """Coefficients (used, 5) of (E, A, B, alpha, beta) refitted on ``rounds`` resamples of the points drawn with
    replacement from a generator seeded by ``seed``, and reason -> count of the resamples skipped."""
    rng = np.random.default_rng(seed)
    draws, skipped = [], {}
    for _ in range(rounds):
        pick = rng.integers(0, len(x), len(x))  # (n,) points drawn with replacement
        if len(np.unique(x[pick])) < 2 or len(np.unique(y[pick])) < 2:
            why = "fewer than 2 distinct N or D"
        else:
            refit = _minimise(x[pick], y[pick], log_loss[pick], delta, starts)
            why = "" if refit.ok else "refit did not converge"
        if why:
            skipped[why] = skipped.get(why, 0) + 1
        else:
            draws.append(_coefficients(refit.theta))
    return np.array(draws).reshape(-1, 5), skipped


def fit_parametric(points: Iterable[Any], delta: float = 1e-3, bootstrap: int = 200, seed: int = 0,
                   starts: int = GRID_STARTS, bootstrap_starts: int = BOOTSTRAP_GRID_STARTS) -> LawFit:
    """Approach 3: minimise sum_i Huber_delta(LSE(a - alpha log N_i, b - beta log D_i, e) - log L_i) with L-BFGS-B,
    keeping the best of several starts, then refit ``bootstrap`` resamples of the points (seeded) for intervals.

    Starts: the paper ran L-BFGS from every point of its grid (4,500). Here the whole grid is scored in one numpy pass
    (a few ms) and L-BFGS-B runs from its ``starts`` best points: on the ladders in the tests every one of the best
    16 reaches the minimum that all 4,500 runs find (from the 19th on, not all do), in 0.1 s instead of 30 s or more.
    A bootstrap refit starts from the main fit's coefficients and the ``bootstrap_starts`` best grid points.

    A fit whose best run did not converge is returned with ``converged=False`` and ``why`` (never raised here, so a
    ladder can still record it); ``LawFit.check()`` raises for callers that need a converged fit. Resamples with
    fewer than 2 distinct N or D, or whose refit did not converge, are skipped and counted in ``bootstrap_skipped``."""
    pts = as_points(points)
    x = np.log([p.params for p in pts])
    y = np.log([p.tokens for p in pts])
    log_loss = np.log([p.loss for p in pts])
    n_sizes, n_tokens = len(np.unique(x)), len(np.unique(y))
    if len(pts) < 5 or n_sizes < 2 or n_tokens < 2:
        raise FitError(f"fit_parametric needs at least 5 points (5 unknowns: E, A, B, alpha, beta) with at least 2 "
                       f"distinct sizes N and 2 distinct token counts D; got {len(pts)} points, {n_sizes} distinct N, "
                       f"{n_tokens} distinct D. Add runs of other sizes and lengths"
                       + (f":\n{_listing(pts)}" if pts else ""))
    if not delta > 0:
        raise FitError(f"fit_parametric: delta={delta} must be positive (the paper's is 1e-3)")
    grid = _grid()
    best_starts = grid[np.argsort(_grid_scores(grid, x, y, log_loss, delta), kind="stable")[:max(starts, 1)]]
    # one BLAS thread: L-BFGS-B's calls on 5-vectors gain nothing from more, and OpenBLAS's idle threads would spin on
    # the other cores for the whole fit (twice the CPU time for the same wall time, measured)
    with threadpool_limits(1):
        run = _minimise(x, y, log_loss, delta, best_starts)
        boot_starts = np.vstack([run.theta, best_starts[:bootstrap_starts]])
        draws, skipped = _bootstrap(x, y, log_loss, delta, boot_starts, bootstrap, seed)
    why = "" if run.ok else (f"L-BFGS-B's best of {len(best_starts)} starts stopped with {run.message!r} and max "
                             f"|gradient| {run.grad:.3g} (tolerance {GRAD_TOL:g}); the points may not pin down all five "
                             "coefficients: add sizes or budgets, or use fit_isoflop")
    intervals = {}
    if len(draws):
        low, high = np.percentile(draws, LEVEL, axis=0)
        intervals = {k: (float(lo), float(hi)) for k, lo, hi in zip(COEFFICIENTS, low, high)}
    return LawFit(*(float(c) for c in _coefficients(run.theta)), points=tuple(pts), delta=delta,
                  objective=run.fun * delta, converged=run.ok, why=why, gradient=run.grad, starts=len(best_starts),
                  bootstrap=bootstrap, bootstrap_used=len(draws), bootstrap_skipped=skipped, intervals=intervals,
                  draws=draws)


def chinchilla_table(fit: LawFit) -> list[dict[str, Any]]:
    """One row per coefficient for display: coefficient, fitted, low and high (its bootstrap interval, None without
    one) and the paper's value."""
    return [{"coefficient": k, "fitted": v, "low": fit.intervals.get(k, (None, None))[0],
             "high": fit.intervals.get(k, (None, None))[1], "chinchilla": CHINCHILLA[k]}
            for k, v in fit.coefficients.items()]
