"""Tests of kiln/sources/manifest.py: unknown keys and bad values named, and the demo and smoke manifests parse."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.common.config import ConfigError
from kiln.sources import load_manifest, specs_from_dicts
from tests.kiln.sources.test_readers import REPO


def test_manifest_unknown_key_and_bad_values(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text("sources:\n  - {name: web, kind: local, format: html, path: x, licence: PD}\n")
    with pytest.raises(ConfigError) as err:
        load_manifest(path)
    for part in (str(path), "source 'web'", "unknown key 'licence'", "Did you mean 'license'"):
        assert part in str(err.value)

    good = {"name": "j", "kind": "local", "format": "jsonl", "path": "x", "license": "PD"}
    for bad, pattern in [
        ({"text_field": 0}, "'text_field' must be a string"),
        ({"kind": "ftp"}, "'kind' must be one of"),
        ({"format": "text", "separator": "("}, "not a valid regex"),
        ({"max_docs": 0}, "max_docs"),
        ({"on_bad_input": "ignore"}, "on_bad_input"),
        ({"max_record_bytes": 0}, "max_record_bytes"),
        ({"kind": "pip", "path": ""}, "needs 'package', 'version' and 'include'"),
    ]:
        with pytest.raises(ConfigError, match=pattern):
            specs_from_dicts([{**good, **bad}], "run config")
    with pytest.raises(ConfigError, match="run config: source 'j': missing required key.*license"):
        specs_from_dicts([{k: v for k, v in good.items() if k != "license"}], "run config")
    with pytest.raises(ConfigError, match="duplicate source name"):
        specs_from_dicts([good, good], "run config")
    path.write_text("sources: []\nextra: 1\n")
    with pytest.raises(ConfigError, match="unknown top-level key 'extra'"):
        load_manifest(path)


def test_demo_and_smoke_manifests_parse() -> None:
    demo = load_manifest(REPO / "conf/sources/demo.yaml")
    smoke = load_manifest(REPO / "conf/sources/smoke.yaml")
    assert {s.format for s in demo} == {"html", "text", "jsonl"}
    assert all(s.kind in ("pip", "apt") and s.sha256 and s.license for s in demo)
    pins = lambda specs: {(s.name, s.kind, s.package, s.version, s.sha256) for s in specs}  # noqa: E731
    assert pins(smoke) == pins(demo)  # same downloads, so the cache is shared
    assert all(s.max_docs and s.max_docs <= 300 for s in smoke)
