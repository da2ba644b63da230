"""Tests for the corpus-level steps: the trained quality classifier, token-distribution outliers, mixing, PII.

Run: python -m pytest tests/kiln/clean/test_quality.py -q
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.clean.config import CleanConfig
from kiln.clean.run import clean
from kiln.clean.quality import QualityModelConfig, TokenDistribution, TokenOutlierConfig, mad_limit, train_classifier
from textgen import prose

SPAM_WORDS = ("deal deals cheap price prices buy order shipping free discount offer offers sale coupon shop "
              "store bonus exclusive limited today now best top click subscribe win").split()


def spam(seed: int, sentences: int = 8) -> str:
    """Advertising copy: English, passes the rule-based filters, unlike reference prose in vocabulary."""
    rng = random.Random(seed)
    out = []
    for _ in range(sentences):
        w = [rng.choice(SPAM_WORDS) for _ in range(7)]
        out.append(f"{w[0].capitalize()} {w[1]} with the {w[2]} {w[3]} and {w[4]} for {w[5]} {w[6]} prices.")
    return " ".join(out)


def write(path: Path, docs: list[tuple[str, str]]) -> Path:
    rows = [{"id": f"{src}-{i}", "source": src, "url": "", "text": t, "content_type": "text/plain",
             "bytes": len(t.encode()), "license": "CC0"} for i, (src, t) in enumerate(docs)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_classifier_separates_reference_from_web_text() -> None:
    pos = [prose(i) for i in range(60)]
    neg = [spam(i) for i in range(60)]
    model, metrics = train_classifier(pos, neg, QualityModelConfig(epochs=4))
    assert metrics["val_accuracy"] >= 0.95 and metrics["positives"] == 60
    scores = model.score([prose(1000), spam(1000)])
    assert scores[0] > 0.7 > 0.3 > scores[1]


def test_quality_filter_in_the_pipeline(tmp_path: Path) -> None:
    docs = [("wiki", prose(i)) for i in range(40)] + [("web", spam(i)) for i in range(30)]
    docs += [("web", prose(500 + i)) for i in range(10)]  # web pages that read like the reference
    raw = write(tmp_path / "raw.parquet", docs)
    cfg = CleanConfig.from_dict({"quality_model": {"reference_sources": ["wiki*"], "min_score": 0.5, "epochs": 4},
                                 "token_outliers": {"enabled": False}})
    report = clean(raw, tmp_path / "c.parquet", tmp_path / "r.parquet", cfg, artifacts_dir=tmp_path)
    kept = pq.read_table(tmp_path / "c.parquet").to_pylist()
    kept_web = [k["id"] for k in kept if k["source"] == "web"]
    assert report.reasons["quality:low_score"]["docs"] >= 25
    assert len(kept_web) >= 8 and all(int(i.split("-")[1]) >= 70 for i in kept_web)  # the prose-like ones
    assert all(0.0 <= k["quality_score"] <= 1.0 for k in kept)
    assert report.quality_model["trained"] and report.quality_model["reference_sources"] == ["wiki*"]
    assert (tmp_path / "quality_model.pt").is_file()
    removed = [r for r in pq.read_table(tmp_path / "r.parquet").to_pylist() if r["reason"] == "quality:low_score"]
    assert removed[0]["detail"].startswith("quality_score=") and "quality_model.min_score=0.5" in removed[0]["detail"]


def test_token_distribution_outliers(tmp_path: Path) -> None:
    dist = TokenDistribution(TokenOutlierConfig())
    for i in range(60):
        dist.add(prose(i))
    dist.freeze()
    rare = "axolotl marmoset glockenspiel quokka narwhal theremin okapi zeppelin pangolin harpsichord".split()
    rng = random.Random(5)
    odd = " ".join(f"{rng.choice(rare).capitalize()}s {rng.choice(['chased', 'tuned', 'fed'])} {rng.choice(rare)}s "
                   f"near the {rng.choice(rare)} with {rng.choice(rare)}s and {rng.choice(rare)}s." for _ in range(9))
    assert dist.kl(odd) > 3 * dist.kl(prose(999))
    med, mad, limit = mad_limit([1.0, 1.1, 0.9, 1.0, 5.0], 8.0)
    assert med == 1.0 and mad == pytest.approx(0.1) and limit == pytest.approx(1.8)

    docs = [("web", prose(i)) for i in range(60)] + [("web", odd)]
    raw = write(tmp_path / "raw.parquet", docs)
    cfg = CleanConfig.from_dict({"quality_model": {"enabled": False}})
    report = clean(raw, tmp_path / "c.parquet", tmp_path / "r.parquet", cfg)
    removed = pq.read_table(tmp_path / "r.parquet").to_pylist()
    assert [(r["id"], r["reason"]) for r in removed] == [("web-60", "outlier:token_kl")]
    assert report.token_outliers["limit_kl"] > report.token_outliers["median_kl"]
