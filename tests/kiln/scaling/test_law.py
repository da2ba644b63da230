"""Chinchilla fits on ladders drawn from a known law: approach 3 recovers its coefficients and predicts a larger run,
approach 2 recovers its compute-optimal exponents, and bad ladders fail with messages that name what is missing.

Run: python -m pytest tests/kiln/scaling/test_law.py -q
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kiln.scaling import law
from kiln.scaling.law import (CHINCHILLA, FitError, ScalingPoint, as_point, chinchilla_table, fit_isoflop,
                              fit_parametric)

REPO = Path(__file__).resolve().parents[3]
TRUE = {"E": 2.0, "A": 300.0, "B": 800.0, "alpha": 0.35, "beta": 0.3}
BUDGETS = (1e17, 1e18, 1e19, 1e20)
RATIOS = (1 / 4, 1 / 2, 1, 2, 4)  # sizes tried per budget, as multiples of the true optimum
HELD_OUT = 1e22  # a hundred times the largest budget: its optimum (N 1.7e9, D 9.5e11) beyond every ladder point


def true_loss(n: float, d: float) -> float:
    return TRUE["E"] + TRUE["A"] / n ** TRUE["alpha"] + TRUE["B"] / d ** TRUE["beta"]


def true_optimum(c: float) -> tuple[float, float]:
    """The law's compute-optimal (N, D) for C = 6ND (the paper's eq. 4)."""
    al, be = TRUE["alpha"], TRUE["beta"]
    g = (al * TRUE["A"] / (be * TRUE["B"])) ** (1 / (al + be))
    n = g * (c / 6) ** (be / (al + be))
    return n, c / 6 / n


def ladder(budgets=BUDGETS, ratios=RATIOS, noise: float = 0.0, seed: int = 0) -> list[dict]:
    """IsoFLOP points: per budget C, sizes N around its optimum, D = C / (6N), loss times exp(noise * normal)."""
    rng = np.random.default_rng(seed)
    points = []
    for c in budgets:
        n_opt, _ = true_optimum(c)
        for r in ratios:
            n = n_opt * r
            d = c / (6 * n)
            loss = true_loss(n, d) * math.exp(noise * rng.standard_normal())
            points.append({"params": n, "tokens": d, "flops": c, "loss": loss, "name": f"C{c:.0e}-x{r:g}"})
    return points


@pytest.fixture(scope="module")
def noisy_fit():
    # 20 points with 0.2% multiplicative noise: about what a seed changes in a small run's final loss
    return fit_parametric(ladder(noise=0.002, seed=0), bootstrap=200, seed=0)


def test_noiseless_points_give_back_the_law():
    fit = fit_parametric(ladder(), bootstrap=0)
    assert fit.converged and fit.why == "" and fit.check() is fit
    assert fit.alpha == pytest.approx(0.35, abs=1e-3) and fit.beta == pytest.approx(0.3, abs=1e-3)
    assert fit.E == pytest.approx(2.0, rel=1e-3)
    assert fit.A == pytest.approx(300.0, rel=1e-3) and fit.B == pytest.approx(800.0, rel=1e-3)
    assert max(abs(r["relative_error"]) for r in fit.residuals()) < 1e-6
    assert fit.intervals == {} and fit.bootstrap_used == 0
    with pytest.raises(FitError, match="no bootstrap fits"):
        fit.interval(1e9, 2e10)


def test_noisy_points_recover_the_exponents_and_predict_a_larger_run(noisy_fit):
    fit = noisy_fit
    assert fit.converged and len(fit.points) == 20
    assert abs(fit.alpha - 0.35) < 0.05 and abs(fit.beta - 0.3) < 0.05
    n, d = true_optimum(HELD_OUT)
    truth = true_loss(n, d)
    assert fit.predict(n, d) == pytest.approx(truth, rel=0.01)
    low, high = fit.interval(n, d)
    assert low < truth < high and high - low < 0.05 * truth
    # every resample of 20 points over 20 sizes keeps 2 distinct N and D, and every refit converged
    assert fit.bootstrap == 200 and fit.bootstrap_used == 200 and fit.bootstrap_skipped == {}
    for k in ("alpha", "beta"):
        lo, hi = fit.intervals[k]
        assert lo < TRUE[k] < hi and lo < getattr(fit, k) < hi


def test_the_fit_is_seeded_and_records_its_metadata(noisy_fit):
    again = fit_parametric(ladder(noise=0.002, seed=0), bootstrap=20, seed=0)
    assert again.alpha == pytest.approx(noisy_fit.alpha, rel=1e-6)  # the same points, the same minimum
    assert fit_parametric(ladder(noise=0.002, seed=0), bootstrap=20, seed=0).intervals == again.intervals
    meta = json.loads(json.dumps(noisy_fit.to_dict()))
    assert meta["points"] == 20 and meta["bootstrap_used"] == 200 and meta["converged"] is True
    assert meta["alpha"] == noisy_fit.alpha and meta["intervals"]["beta"] == list(noisy_fit.intervals["beta"])
    assert len(meta["residuals"]) == 20 and meta["residuals"][0]["name"] == "C1e+17-x0.25"
    # with 0.2% noise the law misses no point by more than 1%
    assert max(abs(r["relative_error"]) for r in meta["residuals"]) < 0.01
    rows = {r["coefficient"]: r for r in chinchilla_table(noisy_fit)}
    assert list(rows) == ["E", "A", "B", "alpha", "beta"]
    assert rows["alpha"]["chinchilla"] == 0.34 and rows["alpha"]["fitted"] == noisy_fit.alpha
    assert rows["alpha"]["low"] < rows["alpha"]["fitted"] < rows["alpha"]["high"]
    assert CHINCHILLA == {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}


def test_optimal_closed_form_matches_the_numerical_path_and_the_truth():
    fit = fit_parametric(ladder(), bootstrap=0)
    for c in (1e18, 1e21, 1e24):
        closed = fit.optimal(c)
        numeric = fit.optimal(c, flops_per_token=lambda n: 6 * n)
        assert numeric[0] == pytest.approx(closed[0], rel=1e-5) and numeric[1] == pytest.approx(closed[1], rel=1e-5)
        n, d = true_optimum(c)
        assert closed[0] == pytest.approx(n, rel=1e-3) and closed[1] == pytest.approx(d, rel=1e-3)
        assert closed[0] * closed[1] * 6 == pytest.approx(c)
    # attention's FLOPs make tokens dearer for small models, so the optimum moves to a larger N on fewer tokens
    heavier = fit.optimal(1e21, flops_per_token=lambda n: 6 * n + 6 * 2048 * 1024)
    assert heavier[0] > fit.optimal(1e21)[0]
    with pytest.raises(FitError, match="at the bound"):
        fit.optimal(1e21, flops_per_token=lambda n: 6 * n, bounds=(1e3, 1e6))


def test_isoflop_recovers_the_compute_optimal_exponents():
    # Along one budget L - E = K(C) (beta e^-alpha u + alpha e^beta u) with u = log(N / N_opt): the same curve in u at
    # every budget, so on sizes that are the same multiples of N_opt the parabola's vertex misses N_opt by the same
    # factor each time and the exponents come out exact
    fit = fit_isoflop(ladder())
    assert all(b.usable for b in fit.budgets) and [b.flops for b in fit.budgets] == list(BUDGETS)
    assert fit.a == pytest.approx(0.3 / 0.65, abs=1e-6) and fit.b == pytest.approx(0.35 / 0.65, abs=1e-6)
    n, d = true_optimum(1e20)
    assert fit.params_for(1e20) == pytest.approx(n, rel=0.05) and fit.tokens_for(1e20) == pytest.approx(d, rel=0.05)
    # D at the vertex is interpolated exactly: each budget's N_opt D_opt is still C / 6
    for b in fit.budgets:
        assert 6 * b.params_opt * b.tokens_opt == pytest.approx(b.flops, rel=1e-9)
        assert b.loss_opt == pytest.approx(true_loss(*true_optimum(b.flops)), rel=1e-3)
    noisy = fit_isoflop(ladder(noise=0.002, seed=0))
    assert abs(noisy.a - 0.3 / 0.65) < 0.03 and abs(noisy.b - 0.35 / 0.65) < 0.03
    meta = json.loads(json.dumps(fit.to_dict()))
    assert meta["budgets_used"] == 4 and len(meta["budgets"][0]["points"]) == 5


def test_a_budget_with_its_minimum_at_the_edge_is_reported_and_left_out():
    points = ladder()
    # every size at C = 1e21 is at most a quarter of its optimum: loss still falls at the largest one
    points += ladder(budgets=(1e21,), ratios=(1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4))
    fit = fit_isoflop(points)
    edge = fit.budgets[-1]
    assert edge.flops == 1e21 and not edge.usable and edge.params_opt is None
    assert edge.why.startswith("minimum at the edge: the budget's optimum is outside the sizes tried")
    assert len(edge.points) == 5
    assert fit.a == pytest.approx(fit_isoflop(ladder()).a, abs=1e-12)  # the fit is the four good budgets'


def test_isoflop_needs_two_usable_budgets():
    points = ladder(budgets=(1e18,)) + ladder(budgets=(1e19,), ratios=(1 / 2, 2))
    with pytest.raises(FitError, match="at least 2 usable budgets") as err:
        fit_isoflop(points)
    assert "got 1 of 2" in str(err.value) and "C=1e+19 (2 points): fewer than 3 distinct sizes (2)" in str(err.value)
    # a budget whose loss peaks in the middle of its sizes (a diverged run, say) has no minimum to use
    hump = [{**p, "loss": 4.0 - (math.log(p["params"]) - 19.5) ** 2 / 10} for p in ladder(budgets=(1e19,))]
    fit = fit_isoflop(ladder(budgets=(1e17, 1e18)) + hump)
    assert [b.usable for b in fit.budgets] == [True, True, False]
    assert fit.budgets[-1].why.startswith("the parabola opens downward")


def test_too_few_points_or_sizes_are_errors_naming_the_counts():
    with pytest.raises(FitError, match="got 4 points, 4 distinct N, 4 distinct D"):
        fit_parametric(ladder()[:4], bootstrap=0)
    one_size = [{"params": 1e8, "tokens": d, "flops": 6e8 * d, "loss": true_loss(1e8, d)} for d in (1e9, 2e9, 4e9,
                                                                                                   8e9, 1.6e10, 3.2e10)]
    with pytest.raises(FitError, match="got 6 points, 1 distinct N, 6 distinct D"):
        fit_parametric(one_size, bootstrap=0)


def test_a_fit_that_did_not_converge_is_returned_marked_and_check_raises(monkeypatch):
    monkeypatch.setattr(law, "GRAD_TOL", 0.0)  # no gradient is small enough: every run counts as not converged
    fit = fit_parametric(ladder(noise=0.002), bootstrap=5)
    assert not fit.converged and "tolerance 0" in fit.why and fit.to_dict()["converged"] is False
    assert fit.bootstrap_used == 0 and fit.bootstrap_skipped == {"refit did not converge": 5}
    with pytest.raises(FitError, match="did not converge") as err:
        fit.check()
    assert "C1e+17-x0.25 (N=" in str(err.value)  # the points are listed


def test_resamples_without_two_sizes_are_skipped_and_counted():
    # two sizes, one point of the second: resamples that miss it have a single N and D
    points = [{"params": 1e8, "tokens": 1e9 * (i + 1), "flops": 6e17 * (i + 1), "loss": true_loss(1e8, 1e9 * (i + 1))}
              for i in range(5)]
    points.append({"params": 1e9, "tokens": 1e10, "flops": 6e19, "loss": true_loss(1e9, 1e10)})
    fit = fit_parametric(points, bootstrap=40, seed=1)
    skipped = fit.bootstrap_skipped.get("fewer than 2 distinct N or D", 0)
    assert skipped > 0 and fit.bootstrap_used + sum(fit.bootstrap_skipped.values()) == 40


def test_points_are_checked_by_key_and_value():
    assert as_point(ScalingPoint(1e8, 2e9, 1.2e18, 3.1)).loss == 3.1
    with pytest.raises(FitError, match=r"scaling point 0 .*unknown key\(s\) \['budget'\]"):
        as_point({"params": 1e8, "tokens": 2e9, "flops": 1.2e18, "loss": 3.1, "budget": 1e18})
    with pytest.raises(FitError, match=r"scaling point 3 .*missing key\(s\) \['loss'\]"):
        as_point({"params": 1e8, "tokens": 2e9, "flops": 1.2e18}, 3)
    with pytest.raises(FitError, match=r"\['loss'\] must be positive and finite"):
        as_point({"params": 1e8, "tokens": 2e9, "flops": 1.2e18, "loss": float("nan")})


def test_the_law_module_imports_neither_dagster_nor_torch():
    code = ("import sys, kiln.scaling.law; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('dagster', 'torch')); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
