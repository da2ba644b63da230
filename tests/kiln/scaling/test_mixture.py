"""Tests of kiln/scaling/mixture.py: mixtures drawn on the simplex reproducibly, and the regression's law and best mixture."""

import numpy as np
import pytest

from kiln.common.config import ConfigError
from kiln.scaling import mixture as kmix


def test_mixtures_are_drawn_on_the_simplex_reproducibly():
    mixes = kmix.draw(["a", "b", "c"], 20, seed=3)
    assert mixes == kmix.draw(["a", "b", "c"], 20, seed=3) and mixes != kmix.draw(["a", "b", "c"], 20, seed=4)
    assert all(abs(sum(m.values()) - 1) < 1e-9 and min(m.values()) >= 0.001 for m in mixes)
    with pytest.raises(ConfigError, match="at least two groups"):
        kmix.draw(["a"], 3, 0)


def test_the_regression_finds_a_linear_law_and_the_best_mixture_leans_to_the_cheapest_group():
    groups = ["a", "b", "c"]
    mixes = kmix.draw(groups, 12, seed=0)
    law = lambda m: 3.0 - 0.4 * m["a"] + 0.2 * m["b"]  # noqa: E731 ("a" lowers bits per byte most)
    rng = np.random.default_rng(0)
    fit = kmix.fit(mixes, [law(m) + rng.normal(0, 0.002) for m in mixes])
    assert fit["r2"] > 0.99 and fit["loo_mae"] < 0.005 < fit["loo_mae_mean"]
    for m in mixes[:3]:
        assert kmix.predict(fit, m) == pytest.approx(law(m), abs=0.01)
    best = kmix.best(fit, seed=1, candidates=20_000, top=50)
    assert max(best["shares"], key=best["shares"].get) == "a" and best["shares"]["a"] > 0.6
    assert best["predicted_bpb"] < min(kmix.predict(fit, m) for m in mixes) + 0.05
    with pytest.raises(ConfigError, match="at least 3"):
        kmix.fit(mixes[:2], [1.0, 2.0])
