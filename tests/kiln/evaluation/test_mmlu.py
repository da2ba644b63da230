"""Tests for kiln.evaluation.mmlu: parsing the pinned file's records, the pin itself, and the task as lm-eval scores it.

Run: python -m pytest tests/kiln/evaluation/test_mmlu.py -q   (no download: the pin is tested on a planted cache)
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest

from kiln.evaluation import run_suite
from kiln.evaluation.spec import write_task
from kiln.evaluation.mmlu import (
    MMLU,
    MMLU_FILE,
    MMLU_SOURCE,
    MMLU_TASK,
    MmluFormatError,
    load_mmlu,
    parse_record,
)
from kiln.sources import RECORD, SourceError, cache_path
from tests.kiln.evaluation.evaluation_kit import NGramLM, enc, tiny_gpt  # noqa: F401  (enc is a fixture)

QUESTIONS = [  # (stem, choices, answer): records in the package's layout are built from these
    ("Which planet is known as the red planet?", ["Venus", "Mars", "Jupiter", "Saturn"], "B"),
    ("What is the boiling point of water at sea level in Celsius?", ["50", "90", "100", "120"], "C"),
    ("Which gas do plants take in for photosynthesis?", ["Carbon dioxide", "Oxygen", "Helium", "Neon"], "A"),
    ("How many sides does a hexagon have?", ["Five", "Seven", "Eight", "Six"], "D"),
]


def record(stem: str, choices: list[str], answer: str, gap: str = "\n") -> dict:
    lettered = "\n".join(f"{k}. {c}" for k, c in zip("ABCD", choices))
    return {"question": f"{stem}{gap}{lettered}\nAnswer:", "answer": answer}


def test_parse_record_reads_the_package_layout():
    got = parse_record(record(*QUESTIONS[0]), "f:1")
    assert got == {"question": QUESTIONS[0][0], "choices": QUESTIONS[0][1], "label": 1}
    assert parse_record(record(*QUESTIONS[1], gap="\n\n"), "f:2")["label"] == 2  # some stems end in a blank line
    with pytest.raises(MmluFormatError, match=r"samples\.jsonl:7: expected"):
        parse_record({"question": "no choices here", "answer": "A"}, "samples.jsonl:7")
    with pytest.raises(MmluFormatError):
        parse_record(record(*QUESTIONS[0][:2], "E"), "f:3")


def test_the_file_pin_rejects_a_changed_file(tmp_path):
    folder = cache_path(MMLU_SOURCE, tmp_path)  # a cache entry as kiln.sources.fetch leaves it
    (folder / MMLU_FILE).parent.mkdir(parents=True)
    (folder / MMLU_FILE).write_text(json.dumps(record(*QUESTIONS[0])) + "\n")
    (folder / RECORD).write_text(json.dumps({"sha256": MMLU_SOURCE.sha256}))  # the package as pinned
    with pytest.raises(SourceError, match=r"samples-all-large\.jsonl: sha256 .* is not the pinned"):
        load_mmlu(tmp_path)


def test_mmlu_task_scores_letters_as_lm_eval_prompts_them(tmp_path, enc):  # noqa: F811
    rows = [{"id": i, **parse_record(record(*q), f"q{i}")} for i, q in enumerate(QUESTIONS)]
    info = write_task(MMLU_TASK, rows, tmp_path, seed=0)  # parsed questions as the kiln_mmlu task's files
    assert info["items"] == 4 and info["chance"] == 0.25
    # a model that memorised each original prompt followed by " <right letter>" must answer every one
    prompts = [record(*q)["question"] + " " + q[2] for q in QUESTIONS]
    cheat = run_suite(NGramLM([enc.encode(p) for p in prompts], n=48, block_size=256), enc, tmp_path, [MMLU])
    assert cheat[MMLU]["acc"] == 1.0 and cheat[MMLU]["items"] == 4 and cheat[MMLU]["chance"] == 0.25
    guess = run_suite(tiny_gpt(block_size=128), enc, tmp_path, [MMLU])
    assert 0.0 <= guess[MMLU]["acc"] <= 1.0 and guess[MMLU]["acc_norm"] is not None
