"""The prompts an arena shows: a file given by the person, else the Kiln home's held-out instruction prompts, else
the built-in list in conf/arena_prompts.yaml.

``load_prompts(path=None, home=Path(".kiln"))`` -> (prompts, where they came from). A file may be YAML (a list, or
``prompts: [...]``), JSONL (objects with a ``prompt``; only the ``val`` split when rows carry one) or plain text
(one prompt a line).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from kiln.common.files import jsonl_objects

BUILT_IN = Path(__file__).resolve().parents[2] / "conf" / "arena_prompts.yaml"


def _from_yaml(path: Path) -> list[str]:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    items = data.get("prompts") if isinstance(data, dict) else data
    if not isinstance(items, list) or not all(isinstance(p, str) for p in items):
        raise ValueError(f"{path}: give a YAML list of prompt strings, or a mapping with key 'prompts' holding one")
    return items


def _from_jsonl(path: Path) -> list[str]:
    rows = []
    for n, row in jsonl_objects(path):
        if not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}:{n}: each line must be an object with a string 'prompt'")
        rows.append(row)
    held_out = [r for r in rows if r.get("split") == "val"]
    return [r["prompt"] for r in (held_out or rows)]


def read_prompts(path: str | Path) -> list[str]:
    """The distinct non-empty prompts of a YAML, JSONL or text file, in file order."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such prompts file; give a YAML, JSONL or text file of prompts")
    if path.suffix in (".yaml", ".yml"):
        items = _from_yaml(path)
    elif path.suffix in (".jsonl", ".json"):
        items = _from_jsonl(path)
    else:
        items = path.read_text(encoding="utf-8").splitlines()
    prompts = list(dict.fromkeys(p.strip() for p in items if p.strip()))
    if not prompts:
        raise ValueError(f"{path}: holds no prompts")
    return prompts


def held_out_pairs(home: Path) -> Path | None:
    """The newest instruction_data pairs file under the Kiln home, or None before that asset has run."""
    found = sorted((home / "storage" / "instruction_data").glob("*/pairs.jsonl"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def load_prompts(path: str | Path | None = None, home: str | Path | None = None) -> tuple[list[str], str]:
    """(prompts, their file): ``path`` when given, else the held-out (val) prompts of the home's instruction_data,
    else the built-in list."""
    if path is not None:
        return read_prompts(path), str(path)
    pairs = held_out_pairs(Path(home)) if home is not None else None
    if pairs is not None:
        rows = [json.loads(line) for line in pairs.read_text(encoding="utf-8").splitlines() if line.strip()]
        val = list(dict.fromkeys(r["prompt"] for r in rows if r.get("split") == "val"))
        if val:
            return val, str(pairs)
    return read_prompts(BUILT_IN), str(BUILT_IN)
