"""Data ablations' core (kiln.scaling.ablation) and mixtures (kiln.scaling.mixture): which fields a point may change,
the points, the checks a point's clean config must pass, the evaluation set's overlap test, the paired comparison
over seeds, and the regression behind a mixture's choice."""

import math

import numpy as np
import pytest

from kiln.common.config import ConfigError
from kiln.scaling import ablation as kabl
from kiln.scaling.sweep import Swept

SOURCES = ["abs-guide", "fortunes", "owt", "owt-mirror", "wikipedia", "wikipedia-shuffled"]


def test_data_fields_are_typed_by_the_clean_config_and_unknown_ones_name_the_valid_ones():
    assert kabl.data_kind("clean.olmo2.enabled") is bool
    assert kabl.data_kind("clean.min_words") is int
    assert kabl.data_kind("clean.quality_model.min_score") is float
    assert kabl.data_kind("clean.minhash.normalise") is str
    assert kabl.data_kind("mix.wikipedia*") is float and kabl.data_kind("tokenizer.vocab_size") is int
    with pytest.raises(ConfigError, match=r"clean has no data field 'olmo3'; choose one of .*olmo2"):
        kabl.data_kind("clean.olmo3.enabled")
    with pytest.raises(ConfigError, match=r"clean.c4 has no data field 'min_sentence'; choose one of .*min_sentences"):
        kabl.data_kind("clean.c4.min_sentence")
    with pytest.raises(ConfigError, match="no data field 'workers'"):  # how the step runs, not what it keeps
        kabl.data_kind("clean.workers")
    with pytest.raises(ConfigError, match=r"mix.<source glob>"):
        kabl.data_kind("clean.mix.weights")
    with pytest.raises(ConfigError, match=r"is a section; name one of its keys: .*clean.minhash.enabled"):
        kabl.data_kind("clean.minhash")
    with pytest.raises(ConfigError, match="is not a data field"):
        kabl.data_kind("model.n_embd")
    with pytest.raises(ConfigError, match="tokenizer.vocab_size"):
        kabl.data_kind("tokenizer.kind")


def test_values_outside_a_fields_domain_are_refused_with_the_legal_range():
    with pytest.raises(ConfigError, match="quality_model.min_score"):
        kabl.expand_data([Swept("clean.quality_model.min_score", values=[1.5])])
    with pytest.raises(ConfigError, match=">= 0"):
        kabl.expand_data([Swept("mix.owt", values=[-1.0])])
    with pytest.raises(ConfigError, match=">= 259"):
        kabl.expand_data([Swept("tokenizer.vocab_size", values=[100])])
    with pytest.raises(ConfigError, match="is not a valid bool"):
        kabl.expand_data([Swept("clean.olmo2.enabled", choices=["maybe"])])


def test_one_at_a_time_gives_the_baseline_and_one_point_per_value():
    points = kabl.expand_data([Swept("clean.olmo2.enabled", choices=["false"]),
                               Swept("clean.min_words", values=[20, 80]),
                               Swept("tokenizer.vocab_size", values=[1024])])
    assert [p.key for p in points] == ["baseline", "olmo2.enabled=false", "min_words=20", "min_words=80",
                                       "vocab_size=1024"]
    assert points[0].values == {} and points[2].values == {"clean.min_words": 20}
    grid = kabl.expand_data([Swept("clean.olmo2.enabled", choices=["true", "false"]),
                             Swept("clean.min_words", values=[20, 80])], mode="grid")
    assert grid[0].key == "baseline" and len(grid) == 5
    assert grid[1].values == {"clean.olmo2.enabled": True, "clean.min_words": 20}
    with pytest.raises(ConfigError, match="fields is empty"):
        kabl.expand_data([])
    with pytest.raises(ConfigError, match="listed more than once"):
        kabl.expand_data([Swept("clean.min_words", values=[20]), Swept("clean.min_words", values=[30])])


def test_a_points_clean_config_takes_its_change_and_refuses_a_change_that_does_nothing():
    cfg = kabl.point_clean({}, {"clean.minhash.enabled": False}, SOURCES, "p")
    assert cfg.minhash.enabled is False and cfg.olmo2.enabled is True
    cfg = kabl.point_clean({"min_words": 30}, {"clean.c4.min_sentences": 3}, SOURCES, "p")
    assert cfg.min_words == 30 and cfg.c4.min_sentences == 3
    with pytest.raises(ConfigError, match=r"p: clean.olmo2.enabled is true in the base clean config already"):
        kabl.point_clean({}, {"clean.olmo2.enabled": True}, SOURCES, "p")
    with pytest.raises(ConfigError, match=r"clean.c4.min_sentences is set but clean.c4.enabled is false in this "
                                          r"point: the rule is off"):
        kabl.point_clean({"c4": {"enabled": False}}, {"clean.c4.min_sentences": 3}, SOURCES, "p")


def test_mixture_weights_are_checked_against_the_sources_and_the_rules_that_need_them():
    mix = {"mix.owt*": 0.5, "mix.wikipedia*": 0.3, "mix.abs-guide": 0.1, "mix.fortunes": 0.1}
    cfg = kabl.point_clean({}, mix, SOURCES, "p")
    assert cfg.mix.weights == {"owt*": 0.5, "wikipedia*": 0.3, "abs-guide": 0.1, "fortunes": 0.1}
    with pytest.raises(ConfigError, match=r"the glob 'books\*' matches none of the sources"):
        kabl.point_clean({}, {**mix, "mix.books*": 0.2}, SOURCES, "p")
    with pytest.raises(ConfigError, match="p: clean.mix.weights: at least one weight must be > 0"):
        kabl.point_clean({}, {k: 0.0 for k in mix}, SOURCES, "p")
    with pytest.raises(ConfigError, match=r"trains on the reference sources \['wikipedia'\]"):
        kabl.point_clean({}, {**mix, "mix.wikipedia*": 0.0}, SOURCES, "p")
    cfg = kabl.point_clean({"quality_model": {"enabled": False}}, {**mix, "mix.wikipedia*": 0.0}, SOURCES, "p")
    assert cfg.mix.weights["wikipedia*"] == 0.0  # without the classifier nothing needs them
    with pytest.raises(ConfigError, match=r"sources \['fortunes'\] match no mix weight"):
        kabl.point_clean({}, {k: v for k, v in mix.items() if k != "mix.fortunes"}, SOURCES, "p")


def words(n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    vocab = [f"w{i}" for i in range(400)]
    return " ".join(vocab[i] for i in rng.integers(0, len(vocab), n))


def test_the_evaluation_set_finds_its_documents_their_copies_and_near_duplicates_only():
    a, b = words(300, 1), words(300, 2)
    index = kabl.EvalSet.of([("e1", a), ("e2", b)])
    near = a.split()
    near[150] = "changed"  # one word of 300: Jaccard of 5-gram shingles about 0.97
    assert index.overlaps([("e1", "anything"), ("x1", a), ("x2", " ".join(near)), ("x3", words(300, 3))]) == [
        True, True, True, False]


def test_compare_pairs_seeds_and_gives_a_t_interval_and_a_verdict():
    base = {0: 2.00, 1: 2.10, 2: 2.05}
    better = kabl.compare(base, {0: 1.90, 1: 2.01, 2: 1.94})  # -0.10, -0.09, -0.11
    assert better["diff"] == pytest.approx(-0.10) and better["verdict"] == "helps"
    half = 4.302652729911275 * 0.01 / math.sqrt(3)  # t(0.975, 2 df) x sd / sqrt(n)
    assert better["low"] == pytest.approx(-0.10 - half) and better["high"] == pytest.approx(-0.10 + half)
    assert better["base_sd"] == pytest.approx(np.std([2.0, 2.1, 2.05], ddof=1))
    noisy = kabl.compare(base, {0: 2.05, 1: 2.02, 2: 2.10})  # +0.05, -0.08, +0.05
    assert noisy["verdict"] == "within noise" and noisy["low"] < 0 < noisy["high"]
    assert kabl.compare(base, {0: 2.3, 1: 2.4, 2: 2.35})["verdict"] == "hurts"
    one = kabl.compare(base, {0: 2.0})
    assert one["verdict"] == "one seed" and one["low"] is None


def test_bits_per_byte_converts_nats_per_token_by_the_evaluation_sets_compression():
    assert kabl.bits_per_byte(math.log(2), 100, 400) == pytest.approx(0.25)
    assert kabl.bits_per_byte(2.0, 1000, 3000) == pytest.approx(2.0 / math.log(2) / 3)


def test_summarize_marks_an_empty_point_and_a_shared_corpus_and_refuses_a_missing_baseline():
    run = lambda seed, bpb, tokens: {"seed": seed, "bpb": bpb, "run_dir": f"runs/{tokens}-{seed}"}  # noqa: E731
    rec = lambda key, bpbs, tokens: {"key": key, "values": {}, "kept_docs": 10, "train_tokens": 100,  # noqa: E731
                                     "epochs": 1.0, "eval_overlap_removed": 2,
                                     "runs": [run(s, b, tokens) for s, b in enumerate(bpbs)]}
    rows = kabl.summarize([{**rec("baseline", [2.0, 2.1], "t0"), "content": "c0"},
                           {**rec("a", [1.9, 2.0], "t1"), "content": "c1"},
                           {"key": "b", "values": {}, "empty": "no document kept", "runs": []},
                           {**rec("c", [2.0, 2.1], "t0"), "content": "c0"},
                           {**rec("vocab", [2.5, 2.62], "t2"), "content": "c0"}])  # the same corpus, its own tokens
    assert rows[0]["verdict"] == "baseline" and rows[1]["diff"] == pytest.approx(-0.1)
    assert rows[2] == {"point": "b", "values": {}, "verdict": "empty corpus", "note": "no document kept"}
    assert rows[3]["verdict"] == "same corpus" and rows[3]["diff"] == 0.0 and "low" not in rows[3]
    assert rows[4]["verdict"] == "hurts" and rows[4]["diff"] == pytest.approx(0.51)  # scored, not "same corpus"
    with pytest.raises(ConfigError, match="baseline point has not run"):
        kabl.summarize([rec("a", [1.0, 1.1], "t1")])


def test_benchmark_scores_are_compared_by_seed_with_higher_better():
    run = lambda seed, acc: {"seed": seed, "benchmarks": {"arc_easy": {"score": acc, "chance": 0.25}}}  # noqa: E731
    base = [run(0, 0.30), run(1, 0.31), run(2, 0.29)]
    better = kabl.benchmark_rows(base, [run(0, 0.40), run(1, 0.42), run(2, 0.41)])["arc_easy"]
    assert better["verdict"] == "helps" and better["diff"] == pytest.approx(0.11) and better["chance"] == 0.25
    assert better["score"] == pytest.approx(0.41)
    worse = kabl.benchmark_rows(base, [run(0, 0.20), run(1, 0.21), run(2, 0.19)])["arc_easy"]
    assert worse["verdict"] == "hurts"
    assert kabl.benchmark_rows([{"seed": 0}], [{"seed": 0}]) == {}  # no benchmark scored: no rows
