"""Bradley-Terry and Elo ratings against values worked out by hand, and the seeded bootstrap intervals.

Run: python -m pytest tests/kiln/arena/test_ratings.py -q
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from kiln.arena.ratings import SCALE, bradley_terry, elo, ratings_table, win_matrix

THREE_OF_FOUR = [("A", "B", 1.0)] * 3 + [("A", "B", 0.0)]


def by_model(rows):
    return {r["model"]: r for r in rows}


def test_three_wins_in_four_give_odds_of_three_to_one():
    # the MLE of P(A beats B) is 3/4, so p_A / p_B = 3: 400 log10(3) Elo points apart, centred on 1000
    w = win_matrix(2, np.array([0, 0, 0, 0]), np.array([1, 1, 1, 1]), np.array([1.0, 1.0, 1.0, 0.0]))
    assert w.tolist() == [[0.0, 3.0], [1.0, 0.0]]
    s = bradley_terry(w, prior=0)
    assert s[0] - s[1] == pytest.approx(math.log(3), abs=1e-8) and s.sum() == pytest.approx(0, abs=1e-12)
    rows = by_model(ratings_table(["A", "B"], THREE_OF_FOUR, prior=0, rounds=20))
    assert rows["A"]["rating"] == pytest.approx(1000 + 200 * math.log10(3), abs=0.05)  # 1095.4
    assert rows["B"]["rating"] == pytest.approx(1000 - 200 * math.log10(3), abs=0.05)  # 904.6
    assert (rows["A"]["votes"], rows["A"]["wins"], rows["A"]["losses"], rows["A"]["ties"]) == (4, 3, 1, 0)
    assert (rows["B"]["votes"], rows["B"]["wins"], rows["B"]["losses"], rows["B"]["ties"]) == (4, 1, 3, 0)


def test_the_default_prior_is_one_virtual_tie_per_pair():
    # one tie more: A has 3.5 of 5, B 1.5, so the odds are 7 to 3
    rows = by_model(ratings_table(["A", "B"], THREE_OF_FOUR, rounds=20))
    assert rows["A"]["rating"] == pytest.approx(1000 + 200 * math.log10(7 / 3), abs=0.05)  # 1073.6
    # a model that won every vote still gets a finite rating: 4.5 to 0.5 is odds of 9
    rows = by_model(ratings_table(["A", "B"], [("A", "B", 1.0)] * 4, rounds=20))
    assert rows["A"]["rating"] == pytest.approx(1000 + 200 * math.log10(9), abs=0.05)


def test_ties_count_half_a_win_each():
    rows = by_model(ratings_table(["A", "B"], [("A", "B", 0.5), ("B", "A", 0.5)], prior=0, rounds=20))
    assert rows["A"]["rating"] == rows["B"]["rating"] == 1000.0
    assert rows["A"]["ties"] == rows["B"]["ties"] == 2 and rows["A"]["wins"] == rows["A"]["losses"] == 0
    # one win and one tie: scores 1.5 to 0.5, the same odds as three wins in four
    rows = by_model(ratings_table(["A", "B"], [("A", "B", 1.0), ("B", "A", 0.5)], prior=0, rounds=20))
    assert rows["A"]["rating"] - rows["B"]["rating"] == pytest.approx(400 * math.log10(3), abs=0.1)


def test_three_models_whose_counts_fit_strengths_four_two_one_exactly():
    # A-B 2:1, B-C 2:1, A-C 4:1 are exactly the expected counts of strengths (4, 2, 1), which is then the MLE
    votes = ([("A", "B", 1.0)] * 2 + [("A", "B", 0.0)] + [("B", "C", 1.0)] * 2 + [("B", "C", 0.0)]
             + [("A", "C", 1.0)] * 4 + [("C", "A", 1.0)])
    rows = ratings_table(["C", "B", "A"], votes, prior=0, rounds=20)
    assert [r["model"] for r in rows] == ["A", "B", "C"]  # best first
    step = 400 * math.log10(2)  # 120.4 points per doubling of strength
    assert [r["rating"] for r in rows] == pytest.approx([1000 + step, 1000, 1000 - step], abs=0.05)
    assert SCALE == pytest.approx(400 / math.log(10))


def test_elo_moves_by_k_times_the_surprise():
    r = elo(2, np.array([0]), np.array([1]), np.array([1.0]))
    assert r.tolist() == pytest.approx([16.0, -16.0])  # expected 0.5, K = 32
    r = elo(2, np.array([0, 0]), np.array([1, 1]), np.array([1.0, 1.0]))
    second = 32 * (1 - 1 / (1 + 10 ** (-32 / 400)))  # A is 32 points ahead before the second vote
    assert r[0] == pytest.approx(16 + second) and r[1] == pytest.approx(-16 - second)
    rows = by_model(ratings_table(["A", "B"], [("A", "B", 1.0)], method="elo", rounds=20))
    assert rows["A"]["rating"] == 1016.0 and rows["B"]["rating"] == 984.0


def test_intervals_hold_the_rating_narrow_with_votes_and_repeat_with_a_seed():
    few = by_model(ratings_table(["A", "B"], THREE_OF_FOUR, seed=3))
    many = by_model(ratings_table(["A", "B"], THREE_OF_FOUR * 10, seed=3))
    for rows in (few, many):
        for r in rows.values():
            assert r["low"] <= r["rating"] <= r["high"] and r["low"] < r["high"]
    width = lambda r: r["high"] - r["low"]  # noqa: E731
    assert width(many["A"]) < width(few["A"]) / 1.8 and width(many["B"]) < width(few["B"]) / 1.8
    assert ratings_table(["A", "B"], THREE_OF_FOUR * 10, seed=3) == ratings_table(["A", "B"], THREE_OF_FOUR * 10, seed=3)
    mixed = THREE_OF_FOUR * 3 + [("B", "C", 1.0), ("C", "A", 0.5), ("A", "C", 1.0), ("B", "C", 0.5)] * 2
    seeded = [ratings_table(["A", "B", "C"], mixed, seed=k, rounds=50) for k in (3, 3, 4)]
    assert seeded[0] == seeded[1]
    assert [(r["low"], r["high"]) for r in seeded[0]] != [(r["low"], r["high"]) for r in seeded[2]]
    assert [r["rating"] for r in seeded[0]] == [r["rating"] for r in seeded[2]]  # the seed moves intervals only
    elo_rows = by_model(ratings_table(["A", "B"], THREE_OF_FOUR * 10, method="elo", seed=3))
    assert elo_rows["A"]["low"] <= elo_rows["A"]["rating"] <= elo_rows["A"]["high"]
    assert elo_rows["A"]["rating"] > elo_rows["B"]["rating"]


def test_no_votes_rate_everyone_1000_and_bad_input_is_named():
    rows = ratings_table(["A", "B"], [])
    # nothing known but the prior's one virtual tie: a wide interval (its Wald interval), not a zero-width one
    assert [(r["rating"], r["low"], r["high"], r["votes"]) for r in rows] == [(1000.0, 659.5, 1340.5, 0)] * 2
    with pytest.raises(ValueError, match=r"model\(s\) \['Z'\] that are not among \['A', 'B'\]"):
        ratings_table(["A", "B"], [("A", "Z", 1.0)])
    with pytest.raises(ValueError, match="unknown method 'glicko'; choose bt"):
        ratings_table(["A", "B"], THREE_OF_FOUR, method="glicko")


def test_votes_all_one_way_still_get_an_interval_that_narrows_with_them():
    """Every resampling of votes that all went one way is the same, so the bootstrap has no spread: such ratings get
    their Bradley-Terry Wald interval (with the prior), which holds the rating and narrows as the votes grow."""
    from kiln.arena.ratings import bt_standard_errors, win_matrix

    one, five = (by_model(ratings_table(["A", "B"], [("A", "B", 1.0)] * k, seed=1)) for k in (1, 5))
    for rows in (one, five):
        for r in rows.values():
            assert r["low"] < r["rating"] < r["high"], r
    assert one["A"]["rating"] < five["A"]["rating"]
    assert five["A"]["high"] - five["A"]["low"] < one["A"]["high"] - one["A"]["low"]
    # two models, one virtual tie and no votes: information 1/4 per direction, so the log-strength's error is 1
    se = bt_standard_errors(win_matrix(2, np.array([], dtype=int), np.array([], dtype=int), np.array([])),
                            np.zeros(2), prior=1.0)
    assert se.tolist() == pytest.approx([1.0, 1.0])
