"""The kiln command line's preset handling."""

import pytest

from jobs.cli import deep_merge, load_preset, main, select_config


def test_deep_merge_overrides_leaves_only():
    base = {"ops": {"a": {"config": {"x": 1, "y": {"z": 2}}}, "b": {"config": {"k": 1}}}}
    over = {"ops": {"a": {"config": {"y": {"z": 3}}}}}
    assert deep_merge(base, over) == {"ops": {"a": {"config": {"x": 1, "y": {"z": 3}}}, "b": {"config": {"k": 1}}}}


def test_select_config_keeps_selected_ops():
    cfg = load_preset("smoke")
    assert set(select_config(cfg, ["tokenizer"])["ops"]) == {"tokenizer"}


def test_unknown_preset_lists_known_ones():
    with pytest.raises(SystemExit, match="known presets: .*smoke"):
        load_preset("nope")


def test_preset_with_bad_top_level_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("opps: {}\n")
    with pytest.raises(SystemExit, match="unknown top-level key"):
        load_preset(str(bad))


def test_run_rejects_unknown_asset(tmp_path):
    with pytest.raises(SystemExit, match="unknown asset"):
        main(["run", "--preset", "smoke", "--select", "tokenizr", "--home", str(tmp_path)])
