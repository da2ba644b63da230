"""Mathematics with checkable answers from a pinned public package (evals==3.0.1.post1, MIT) as local lm-eval tasks:
``kiln_math_word`` (20 grade-school word problems, ``math_for_5th-grader``) and ``kiln_math_expr`` (100 arithmetic
expressions written in words, ``math_equations``, answers rounded to 4 decimals).

The model continues "Question: ...\\nAnswer:" greedily (lm-eval's ``generate_until``, at most 24 tokens, to the end
of the line); the first number it writes is its answer, compared with the reference after both drop trailing zeros
("5619.0000" and "5619" are the same answer, "7.20" is "7.2"), as exact match. Chance is 0: there is no finite set
to guess from. Run: ``python -m kiln.evaluation.mathematics OUT_DIR [--cache-dir DIR]``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from kiln.evaluation.mmlu import MMLU_SOURCE, pinned_file
from kiln.evaluation.spec import FromPackage, TaskSpec, build_package_task
from kiln.sources import SourceSpec

MATH_WORD, MATH_EXPR = "kiln_math_word", "kiln_math_expr"
FILES = {  # task -> (file in the evals wheel, its sha256)
    MATH_WORD: ("evals/registry/data/math_for_5th-grader/samples.jsonl",
                "9a9c93da42ebd1e5d9846a85767946ef533756ab393a785b33caf63ba413be36"),
    MATH_EXPR: ("evals/registry/data/math_equations/math_equations.jsonl",
                "9bfafa516aca3b9e36cdcc794c463970f33cba7e6cd80b79d96b4a2ae8336c1d"),
}
MATH_SOURCE = SourceSpec(
    name="math", kind="pip", package="evals", version=MMLU_SOURCE.version, archive="wheel", sha256=MMLU_SOURCE.sha256,
    include=[path for path, _ in FILES.values()], format="jsonl", text_field="input",
    license="MIT (openai/evals, its contributed eval data included)",
)
# a number, with its decimals only up to the last non-zero digit: "5619.0000" -> "5619", "282.60" -> "282.6"
NUMBER = r"(-?\d+(?:\.\d*[1-9])?)"
_NUMBER = re.compile(NUMBER)


class MathFormatError(ValueError):
    """A record of a mathematics file is not a question with a bracketed numeric answer; names file and line."""


def canonical(answer: str) -> str | None:
    """The reference as the scorer reads a model's answer: the first number, trailing zeros dropped."""
    m = _NUMBER.search(answer.replace(",", ""))
    return m.group(1) if m else None


def parse_record(record: dict[str, Any], where: str) -> dict[str, Any]:
    """{"input": [system, user], "ideal": "[1440]" or ["[5619]", "[5619.0000]"]} -> {question, answer}."""
    turns = record.get("input")
    ideal = record.get("ideal")
    ideals = ideal if isinstance(ideal, list) else [ideal]
    question = next((t.get("content") for t in turns or [] if isinstance(t, dict) and t.get("role") == "user"), None)
    answers = {canonical(a) for a in ideals if isinstance(a, str)}
    if not question or len(answers) != 1 or None in answers:
        raise MathFormatError(f"{where}: expected a user turn and one numeric answer in 'ideal', got "
                              f"ideal={ideal!r}; the package file changed: re-pin its sha256 after checking it")
    return {"question": question.strip(), "answer": answers.pop()}


def load_math(task: str, cache_dir: str | Path) -> list[dict[str, Any]]:
    """Every item of ``task``'s pinned file, in file order, ``id`` its 0-based line number."""
    path = pinned_file(MATH_SOURCE, *FILES[task], cache_dir)
    return [{"id": i, **parse_record(json.loads(line), f"{path}:{i + 1}")}
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()) if line.strip()]


def _spec(task: str, what: str) -> TaskSpec:
    return TaskSpec(
        name=task, chance=0.0, primary="exact_match", suite="math", items=FromPackage(lambda d: load_math(task, d)),
        lm_eval={
            "output_type": "generate_until", "doc_to_text": "Question: {{question}}\nAnswer:",
            "doc_to_target": "answer",
            "generation_kwargs": {"until": ["\n", "Question:", "<|endoftext|>"], "max_gen_toks": 24,
                                  "do_sample": False},
            "filter_list": [{"name": "first_number", "filter": [
                {"function": "regex", "regex_pattern": NUMBER, "fallback": "[no number]"},
                {"function": "take_first"}]}],
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"source": f"{MATH_SOURCE.package}=={MATH_SOURCE.version}:{FILES[task][0]}", "what": what},
        },
        item_text=lambda row: row["question"],
    )


MATH_WORD_TASK = _spec(MATH_WORD, "grade-school word problems")
MATH_EXPR_TASK = _spec(MATH_EXPR, "arithmetic expressions in words, answers to 4 decimals")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--cache-dir", default=".kiln/storage/cache/sources", help="download cache for the evals wheel")
    args = p.parse_args(argv)
    for spec in (MATH_WORD_TASK, MATH_EXPR_TASK):
        print(json.dumps(build_package_task(spec, args.out_dir, args.cache_dir), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
