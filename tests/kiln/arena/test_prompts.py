"""Tests of kiln/arena/prompts.py: the arena's prompts from a file, the home or the built-in list."""

from __future__ import annotations

import pytest

from kiln.arena.prompts import BUILT_IN, load_prompts, read_prompts


def test_prompts_from_a_file_the_home_or_the_built_in_list(tmp_path):
    (tmp_path / "p.txt").write_text("one\n\ntwo\none\n")
    assert read_prompts(tmp_path / "p.txt") == ["one", "two"]
    (tmp_path / "p.yaml").write_text("prompts: [a, b]\n")
    assert read_prompts(tmp_path / "p.yaml") == ["a", "b"]
    (tmp_path / "p.jsonl").write_text('{"prompt": "t", "split": "train"}\n{"prompt": "v", "split": "val"}\n')
    assert read_prompts(tmp_path / "p.jsonl") == ["v"]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "t"}\n{"text": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: each line must be an object with a string 'prompt'"):
        read_prompts(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="no such prompts file"):
        read_prompts(tmp_path / "missing.yaml")
    home = tmp_path / "home"
    prompts, where = load_prompts(None, home)
    assert where == str(BUILT_IN) and len(prompts) >= 10
    pairs = home / "storage" / "instruction_data" / "abc" / "pairs.jsonl"
    pairs.parent.mkdir(parents=True)
    pairs.write_text('{"prompt": "held out", "split": "val"}\n{"prompt": "trained on", "split": "train"}\n')
    assert load_prompts(None, home) == (["held out"], str(pairs))
