"""Tests of kiln/clean/mixing.py: the mix plan and its sampling, alone and in the pipeline."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.clean.config import CleanConfig
from kiln.clean.mixing import MixConfig, keep_sample, plan_mix
from kiln.clean.run import clean
from kiln.common.config import ConfigError
from tests.kiln.clean.test_quality import write
from textgen import prose


def test_mix_plan_and_sampling(tmp_path: Path) -> None:
    plan = plan_mix({"web": 8000, "books": 1000, "code": 2000},
                    MixConfig(weights={"web": 0.5, "books": 0.25, "code": 0.25}))
    assert plan["rates"] == {"web": 0.25, "books": 1.0, "code": 0.5}  # books are the limit: kept whole
    assert plan["groups"]["web"]["target_share"] == 0.5
    grouped = plan_mix({"owt": 3000, "owt-2": 1000, "wiki": 1000}, MixConfig(weights={"owt*": 1, "wiki": 1}))
    assert grouped["rates"] == {"owt": 0.25, "owt-2": 0.25, "wiki": 1.0}
    assert plan_mix({"a": 5}, MixConfig())["rates"] == {"a": 1.0}
    with pytest.raises(ConfigError, match=r"source\(s\) \['code'\] match no glob"):
        plan_mix({"web": 1, "code": 1}, MixConfig(weights={"web": 1}))
    with pytest.raises(ConfigError, match="must map to a number >= 0"):
        MixConfig(weights={"web": -1})
    kept = sum(keep_sample(f"id{i}", 0.3, 0) for i in range(2000))
    assert 520 < kept < 680 and keep_sample("x", 0.3, 0) == keep_sample("x", 0.3, 0)

    docs = [("web", prose(i)) for i in range(60)] + [("books", prose(100 + i)) for i in range(20)]
    raw = write(tmp_path / "raw.parquet", docs)
    cfg = CleanConfig.from_dict({"mix": {"weights": {"web": 0.5, "books": 0.5}}, "quality_model": {"enabled": False}})
    report = clean(raw, tmp_path / "c.parquet", tmp_path / "r.parquet", cfg)
    assert report.mix["groups"]["web"]["rate"] == pytest.approx(1 / 3, rel=0.05)
    assert abs(report.mix["groups"]["web"]["final_share"] - 0.5) < 0.15
    assert report.reasons["mix:downsampled"]["docs"] == 60 - report.sources["web"]["kept_docs"]
    assert report.config["mix"]["weights"] == {"web": 0.5, "books": 0.5}  # in the report, so in lineage
