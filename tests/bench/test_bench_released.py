"""bench/bench_released.py: the card table from a parity run's Kiln side."""

import json

import pytest
from bench_module import load_bench


def parity_row(name: str, primary: str, score: float, stderr: float) -> dict:
    return {"benchmark": name, "items": 200, "requests": 800, "primary": primary, "kiln_score": score,
            "kiln_stderr": stderr, "kiln_seconds": 10.0, "hf_score": score, "hf_stderr": stderr}


def test_a_parity_runs_kiln_side_goes_beside_the_card_with_the_arc_mean_and_its_interval(tmp_path):
    bench = load_bench("bench_released")
    parity = tmp_path / "parity.json"
    parity.write_text(json.dumps({
        "command": "python bench/bench_parity.py --hf m.gguf", "commit": "abc", "date": "2026-01-01",
        "machine": "cpu | 2 cores", "model": "/x/SmolLM2-135M-Instruct.Q4_1.gguf",
        "args": {"device": "cpu", "batch_size": 16, "seed": 7, "mc_items": 200, "gen_items": 50},
        "rows": [parity_row("arc_easy", "acc_norm,none", 0.44, 0.03),
                 parity_row("arc_challenge", "acc_norm,none", 0.30, 0.04), parity_row("hellaswag", "acc_norm,none", 0.41, 0.035)]}))
    out = tmp_path / "released"
    result = bench.main(["--from-parity", str(parity), "--out", str(out)])
    rows = {r["benchmark"]: r for r in result["rows"]}
    assert rows["hellaswag"]["score"] == 0.41 and rows["hellaswag"]["chance"] == 0.25 and rows["mmlu"]["score"] is None
    assert result["measured_by"][0]["commit"] == "abc" and result["seed"] == 7
    md = out.with_suffix(".md").read_text()
    # ARC (Average): (44 + 30) / 2 = 37.0, interval 1.96 * sqrt(3^2 + 4^2) / 2 = 4.9; card 37.3
    assert "| ARC (Average) | 37.3 | 37.0 ± 4.9 | -0.3 |" in md
    assert "| HellaSwag | 40.9 | 41.0 ± 6.9 | +0.1 |" in md and "| MMLU (cloze) | 29.3 | not scored | - |" in md
    assert "`python bench/bench_parity.py --hf m.gguf` at commit abc" in md
    later = tmp_path / "later.json"  # a benchmark measured again: the later file's row is taken
    later.write_text(json.dumps({"command": "python bench/bench_parity.py --tasks hellaswag", "commit": "def",
                                 "date": "2026-01-02", "machine": "cpu | 2 cores", "model": "/x/m.gguf", "args": {},
                                 "rows": [parity_row("hellaswag", "acc_norm,none", 0.43, 0.035)]}))
    again = bench.main(["--from-parity", str(parity), str(later), "--out", str(out)])
    assert {r["benchmark"]: r["score"] for r in again["rows"] if r["score"] is not None} == {
        "arc_easy": 0.44, "arc_challenge": 0.30, "hellaswag": 0.43}
    assert [r["commit"] for r in again["measured_by"]] == ["abc", "def"]


def test_a_file_that_is_not_a_parity_run_is_named(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match=r"x\.json: not a bench_parity\.py results file"):
        load_bench("bench_released").main(["--from-parity", str(bad), "--out", str(tmp_path / "o")])
