"""Tests of kiln/filters/base.py: every default rule keeps clean prose, and the signals a Doc carries do not depend on
the Python hash seed (each filter's own rules: tests/kiln/filters/test_<filter>.py).

Run: python -m pytest tests/kiln/filters/test_base.py -q
"""

from __future__ import annotations

from pathlib import Path

from kiln.clean.config import CleanConfig, default_filters
from tests.kiln.filters.filters_kit import doc
from textgen import prose


def test_clean_prose_passes_every_default_rule() -> None:
    for seed in range(20):
        d = doc(prose(seed))
        assert [f.reason(d) for f in default_filters(CleanConfig())] == [None] * 8, seed


def test_signals_do_not_depend_on_the_python_hash_seed() -> None:
    """Shards are cleaned in separate processes: every signal must be the same whatever PYTHONHASHSEED is."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json, sys; sys.path.append('tests'); from textgen import prose; "
            "from kiln.clean.config import CleanConfig, default_filters; from kiln.filters.base import Doc; "
            "d = Doc('d', 's', '', prose(3) + ' river bank river bank', 'text/plain', '', 0); "
            "[f.reason(d) for f in default_filters(CleanConfig())]; "
            "print(json.dumps({k: v for k, v in d.signals.items() if not k.startswith('_')}, sort_keys=True))")
    root = Path(__file__).resolve().parents[3]
    outs = [subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    assert outs[0] == outs[1] and json.loads(outs[0])["top_2gram_char_fraction"] > 0
