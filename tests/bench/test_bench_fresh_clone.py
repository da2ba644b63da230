"""bench/bench_fresh_clone.py: the run's log read into its pytest summary, slowest tests and per-asset times, and the
CPU accounting put as shares of the machine's cores."""

import json

from bench_module import load_bench

LOG = """..........
============================= slowest 25 durations =============================
242.70s setup    tests/test_e2e.py::test_every_asset_materialized_with_a_data_version
59.25s call     tests/ui/test_ui_script.py::test_ui_script_stops_every_child_on_ctrl_c[parent]
1702 passed, 393 warnings in 1532.22s (0:25:32)
"""


def test_a_test_log_gives_the_summary_and_the_slowest_tests_and_the_cpu_shares_add_up(tmp_path):
    bench = load_bench("bench_fresh_clone")
    before = {k: 0 for k in bench.STAT_FIELDS}
    after = {**before, "user": 300, "system": 100, "idle": 500, "iowait": 50, "steal": 50}  # 1,000 ticks
    cpu = bench.cpu_use(before, after, children_s=150.0, wall=100.0)
    assert cpu["machine"] == {"busy": 0.4, "idle": 0.5, "iowait": 0.05, "steal": 0.05}
    assert cpu["command_share"] == round(150.0 / (cpu["cores"] * 100.0), 3)
    result = {"command": "c", "commit": "abc", "date": "d", "machine": "m", "what": "make test TEST_WORKERS=3",
              "clone_commit": "abc", "returncode": 0, "wall_s": 1640.0, "cpu": cpu}
    assert bench.write(result, LOG, tmp_path / "out", "test", []) == 0
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["pytest"] == {"summary": "1702 passed, 393 warnings", "seconds": 1532.22}
    assert saved["slowest"][0] == {"seconds": 242.7, "phase": "setup",
                                   "test": "tests/test_e2e.py::test_every_asset_materialized_with_a_data_version"}
    assert saved["slowest"][1]["test"].endswith("[parent]") and len(saved["slowest"]) == 2
    md = (tmp_path / "out.md").read_text()
    assert md.startswith("# `make test TEST_WORKERS=3` from a fresh clone")
    assert "busy 40%, idle 50%, waiting for disk 5%, and 5% was taken" in md and "| 242.7 |" in md


def test_a_demo_log_gives_each_assets_time_and_what_it_made(tmp_path):
    bench = load_bench("bench_fresh_clone")
    log = ("▶ base_model\n  base_model step 700/700  loss 4.7230\n✓ base_model            3m49s  validation loss 4.793, "
           "6,763 tokens/s\n✓ training_plan            0s  4,000,000 parameters\n✓ red_team_report         14s\n")
    result = {"command": "c", "commit": "abc", "date": "d", "machine": "m", "what": "make demo", "clone_commit": "abc",
              "returncode": 0, "wall_s": 646.0}
    bench.write(result, log, tmp_path / "demo", "demo", [])
    saved = json.loads((tmp_path / "demo.json").read_text())
    assert saved["assets"] == {"base_model": 229, "training_plan": 0, "red_team_report": 14}
    assert saved["outcomes"] == {"base_model": "validation loss 4.793, 6,763 tokens/s",
                                 "training_plan": "4,000,000 parameters", "red_team_report": ""}
    assert "| base_model | 229 | validation loss 4.793, 6,763 tokens/s |" in (tmp_path / "demo.md").read_text()
