"""``kiln status``'s config diff. Its predictions against real smoke materializations are checked in
tests/test_e2e.py, before each of that suite's reruns, against what the rerun recomputed.

Run: python -m pytest -q tests/jobs/test_status.py
"""

from jobs.status import config_changes


def test_config_changes_name_the_field_with_old_and_new_value():
    assert config_changes({"clean": {"min_words": 50, "x": 1}}, {"clean": {"min_words": 80, "x": 1}}) == [
        "config clean.min_words 50 -> 80"]
    assert config_changes({"tasks": []}, {"tasks": ["a"]}) == ['config tasks [] -> ["a"]']
