"""Helpers of the pretrained-import tests: the tiny model folders' cases, and a copy of one folder to damage."""

import shutil

CASES = [("gpt2", "gpt2", False), ("llama", "llama3", True), ("qwen3", "qwen2", False), ("llama", "smollm", False)]


def _copy(folders, tmp_path, key=("gpt2", "gpt2")):
    return shutil.copytree(folders[key], tmp_path / "bad")
