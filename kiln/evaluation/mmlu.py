"""MMLU questions from a pinned public package (evals==3.0.1.post1, MIT) as a local lm-eval task, ``kiln_mmlu``.

Run: ``python -m kiln.evaluation.mmlu OUT_DIR [--cache-dir DIR] [--n-items N]`` (fetches the wheel once, then offline).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from kiln.common.files import sha256_file
from kiln.evaluation.spec import FromPackage, TaskSpec, build_package_task
from kiln.sources import SourceError, SourceSpec, fetch

MMLU = "kiln_mmlu"
MMLU_CHANCE = 0.25  # one of four letters
MMLU_FILE = "evals/registry/data/sandbagging/samples-all-large.jsonl"  # 1,000 MMLU test questions across subjects
MMLU_FILE_SHA256 = "ae8f5342c41efd39921ee0e16c19c3ac3ef09cd8cf367158b47c69592e8f8fac"
MMLU_SOURCE = SourceSpec(
    name="mmlu",
    kind="pip",
    package="evals",
    version="3.0.1.post1",
    archive="wheel",
    sha256="0abcb2051303500784b1641a6e4f6b813ed43ad64f879a37d344a6774eb8eb78",
    include=[MMLU_FILE],
    format="jsonl",
    text_field="question",
    license="MIT (openai/evals; MMLU, Hendrycks et al. 2021, MIT)",
)
LETTERS = ("A", "B", "C", "D")
# lm-eval's own MMLU prompt (tasks/mmlu/default/_default_template_yaml): question, lettered choices, "Answer:".
DOC_TO_TEXT = "{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\nC. {{choices[2]}}\nD. {{choices[3]}}\nAnswer:"

_PROMPT = re.compile(r"^(?P<q>.*?)\n+A\. (?P<a>.*?)\nB\. (?P<b>.*?)\nC\. (?P<c>.*?)\nD\. (?P<d>.*?)\nAnswer:\s*$", re.S)


class MmluFormatError(ValueError):
    """A record of the MMLU file does not have the expected prompt layout; the message names file and line."""


def parse_record(record: dict[str, Any], where: str) -> dict[str, Any]:
    """{"question": "...\\nA. x\\nB. y\\nC. z\\nD. w\\nAnswer:", "answer": "B"} -> {question, choices, label}."""
    m = _PROMPT.match(record.get("question", ""))
    answer = record.get("answer")
    if m is None or answer not in LETTERS:
        raise MmluFormatError(
            f"{where}: expected 'question' with lettered choices A-D ending in 'Answer:' and 'answer' in A-D, "
            f"got keys {sorted(record)}; the package file changed: re-pin MMLU_FILE_SHA256 after checking it"
        )
    return {"question": m["q"].strip(), "choices": [m[k].strip() for k in "abcd"], "label": LETTERS.index(answer)}


def pinned_file(source: SourceSpec, rel: str, sha256: str, cache_dir: str | Path) -> Path:
    """File ``rel`` of a pinned package (fetched once into cache_dir), its sha256 checked against ``sha256``."""
    root = fetch(source, cache_dir)
    path = root / rel
    if not path.is_file():
        raise SourceError(f"{path}: not in {source.package} {source.version}; the wheel's layout changed")
    digest = sha256_file(path)
    if digest != sha256:
        raise SourceError(f"{path}: sha256 {digest} is not the pinned {sha256}; delete {root} and refetch")
    return path


def load_mmlu(cache_dir: str | Path) -> list[dict[str, Any]]:
    """Every question of the pinned file, in file order, with ``id`` = its 0-based line number."""
    path = pinned_file(MMLU_SOURCE, MMLU_FILE, MMLU_FILE_SHA256, cache_dir)
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if line.strip():
            rows.append({"id": i, **parse_record(json.loads(line), f"{path}:{i + 1}")})
    return rows


MMLU_TASK = TaskSpec(
    name=MMLU, chance=MMLU_CHANCE, primary="acc", suite="mmlu", items=FromPackage(load_mmlu),
    # lm-eval's own mmlu scoring: multiple choice over the four letters, zero-shot
    lm_eval={"output_type": "multiple_choice", "doc_to_text": DOC_TO_TEXT, "doc_to_choice": list(LETTERS),
             "doc_to_target": "label",
             "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in ("acc", "acc_norm")],
             "metadata": {"source": f"{MMLU_SOURCE.package}=={MMLU_SOURCE.version}:{MMLU_FILE}"}},
    item_text=lambda row: " ".join([row["question"], *map(str, row["choices"])]),  # every choice is in the prompt
)


def build_mmlu_task(out_dir: str | Path, cache_dir: str | Path, n_items: int | None = None, seed: int = 1234) -> dict[str, Any]:
    """Write ``kiln_mmlu.jsonl`` + ``kiln_mmlu.yaml`` into out_dir: all questions, or a seeded sample of n_items.

    Returns {"items": n, "path": yaml, "data": jsonl, "chance": 0.25}, the shape ``build_tasks`` returns per task.
    """
    return build_package_task(MMLU_TASK, out_dir, cache_dir, n_items, seed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--cache-dir", default=".kiln/storage/cache/sources", help="download cache for the evals wheel")
    p.add_argument("--n-items", type=int, default=None, help="seeded sample of this many questions (default: all)")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    print(json.dumps(build_mmlu_task(args.out_dir, args.cache_dir, args.n_items, args.seed), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
