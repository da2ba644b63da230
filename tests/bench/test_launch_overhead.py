"""bench/launch_overhead.py: both arms launch the same tracked job through torchrun, leave the same records in MLflow,
and the ratio comes from their medians."""

import json

import pytest

from bench_module import load_bench


@pytest.mark.slow
def test_both_arms_launch_and_record_the_same_and_the_ratio_comes_from_the_medians(tmp_path):
    bench = load_bench("launch_overhead")
    r = bench.main(["--launches", "1", "--steps", "4", "--out", str(tmp_path / "overhead")])
    assert r["same_records"] and r["launches"] == 1
    assert set(r["median_s"]) == set(bench.ARMS) and all(v > 0 for v in r["median_s"].values())
    assert r["ratio"] == r["median_s"]["worker sends"] / r["median_s"]["spooled"]
    assert {"train_loss", "val_loss", "system/cpu_utilization_percentage"} <= set(r["recorded"]["keys"])
    assert r["recorded"]["params"]["job.max_steps"] == "4"
    written = json.loads((tmp_path / "overhead.json").read_text())
    assert written["ratio"] == r["ratio"] and written["machine"]
    assert "| spooled |" in (tmp_path / "overhead.md").read_text()
