"""The eval task registry: every local task (one TaskSpec each) and the chance baselines of lm-eval's own tasks.

Add a task: write its TaskSpec and add it to LOCAL_TASKS. ``python -m kiln.evaluation.registry`` prints the table.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from kiln.evaluation.coding import HUMANEVAL_TASK
from kiln.evaluation.heldout import CONTINUATION_TASK, LASTWORD_TASK, PPL_TASK
from kiln.evaluation.mathematics import MATH_EXPR_TASK, MATH_WORD_TASK
from kiln.evaluation.mmlu import MMLU_TASK
from kiln.evaluation.spec import CLEAN_SUFFIX, LOCAL_PREFIX, TaskSpec, TaskSpecError
from kiln.evaluation.standard.catalog import BENCHMARKS, Benchmark

LOCAL_TASKS = (PPL_TASK, CONTINUATION_TASK, LASTWORD_TASK, MMLU_TASK,  # one entry per task, in build and suite order
               MATH_WORD_TASK, MATH_EXPR_TASK, HUMANEVAL_TASK)
# lm-eval's own tasks: the expected score of uniform guessing; None where no such number exists (perplexity).
STANDARD_CHANCE: dict[str, float | None] = {
    "hellaswag": 0.25, "arc_easy": 0.25, "arc_challenge": 0.25, "openbookqa": 0.25, "sciq": 0.25, "mmlu": 0.25,
    "piqa": 0.5, "winogrande": 0.5, "copa": 0.5, "boolq": 0.5, "lambada_openai": 0.0, "lambada_standard": 0.0,
    "wikitext": None,
}


class UnknownTaskError(TaskSpecError, KeyError):
    """A kiln_* task name that no TaskSpec is registered under; the message lists the registered ones."""

    def __str__(self) -> str:
        return str(self.args[0])


class UnknownBenchmarkError(UnknownTaskError):
    """A standard benchmark name that is not registered; the one-line message lists the registered ones."""


class TaskRegistry:
    """Local tasks by name, in registration order, plus lm-eval's own tasks' chance baselines.

    Names starting with ``kiln_`` are Kiln's: each must be registered (asking for an unknown one is an error);
    any other name is lm-eval's, scored with its own YAML, chance from ``standard`` (None when not listed) and
    judged by acc_norm where lm-eval reports it, else acc.
    """

    def __init__(self, local: Iterable[TaskSpec] = (), standard: Mapping[str, float | None] | None = None,
                 benchmarks: Iterable[Benchmark] = ()):
        self._local: dict[str, TaskSpec] = {}
        self._standard = dict(standard or {})
        self._benchmarks: dict[str, Benchmark] = {}
        for spec in local:
            self.register(spec)
        for bench in benchmarks:
            self.register_benchmark(bench)

    def register(self, spec: TaskSpec) -> TaskSpec:
        """Add a task; a second task of the same name is an error."""
        if not isinstance(spec, TaskSpec):
            raise TaskSpecError(f"only a TaskSpec can be registered as an eval task, got {spec!r}")
        if spec.name in self._local:
            raise TaskSpecError(f"eval task {spec.name!r} is registered twice; give the new task another name")
        self._local[spec.name] = spec
        return spec

    def register_benchmark(self, bench: Benchmark) -> Benchmark:
        """Add a standard benchmark (lm-eval's own task on pinned data); a second one of the same name is an error."""
        if not isinstance(bench, Benchmark):
            raise TaskSpecError(f"only a Benchmark can be registered as a standard benchmark, got {bench!r}")
        if bench.name in self._benchmarks or bench.name.startswith(LOCAL_PREFIX):
            raise TaskSpecError(f"standard benchmark {bench.name!r} is registered twice or named like a kiln_* task")
        self._benchmarks[bench.name] = bench
        return bench

    def benchmark(self, name: str) -> Benchmark:
        """The entry of a standard benchmark; an unknown name raises UnknownBenchmarkError listing the known ones."""
        if name not in self._benchmarks:
            raise UnknownBenchmarkError(f"unknown benchmark {name!r}; known: {', '.join(self._benchmarks)} (add one "
                                        "as a Benchmark entry in kiln/evaluation/standard/catalog.py)")
        return self._benchmarks[name]

    def benchmark_names(self) -> list[str]:
        """The standard benchmarks, in registration order."""
        return list(self._benchmarks)

    def snapshot(self) -> tuple[dict[str, TaskSpec], dict[str, float | None], dict[str, Benchmark]]:
        return dict(self._local), dict(self._standard), dict(self._benchmarks)

    def restore(self, snapshot: tuple) -> None:
        self._local, self._standard = dict(snapshot[0]), dict(snapshot[1])
        if len(snapshot) > 2:
            self._benchmarks = dict(snapshot[2])

    def local(self, kind: type | None = None) -> list[TaskSpec]:
        """The registered tasks, in order; with ``kind`` (FromDocuments, FromPackage) those whose items are made so."""
        return [s for s in self._local.values() if kind is None or isinstance(s.items, kind)]

    def get(self, name: str) -> TaskSpec:
        """The spec of a local task or of its ``_clean`` copy; an unknown name raises UnknownTaskError."""
        base = name.removesuffix(CLEAN_SUFFIX)
        if base not in self._local:
            raise UnknownTaskError(f"eval task {name!r} is not registered (registered: {sorted(self._local)}); write "
                                   "its TaskSpec and add it to LOCAL_TASKS in kiln/evaluation/registry.py")
        return self._local[base]

    def chance(self, name: str) -> float | None:
        """Expected score of uniform guessing on a task (or its ``_clean`` copy); None where there is none."""
        if name.startswith(LOCAL_PREFIX):
            return self.get(name).chance
        base = name.removesuffix(CLEAN_SUFFIX)
        return self._benchmarks[base].chance if base in self._benchmarks else self._standard.get(base)

    def primary(self, name: str, row: dict[str, Any]) -> str | None:
        """The metric a task is judged by, if ``row`` (one task's scores) holds a number for it."""
        base = name.removesuffix(CLEAN_SUFFIX)
        if name.startswith(LOCAL_PREFIX):
            metric = self.get(name).primary
        elif base in self._benchmarks:
            metric = self._benchmarks[base].primary.split(",", 1)[0]  # lm-eval's "acc,none" -> "acc"
        else:
            metric = "acc_norm" if "acc_norm" in row else "acc"
        return metric if isinstance(row.get(metric), (int, float)) else None

    def suites(self) -> dict[str, list[str]]:
        """Default checkpoint suites: {suite: its tasks}, from each spec's ``suite``, in registration order."""
        out: dict[str, list[str]] = {}
        for spec in self._local.values():
            out.setdefault(spec.suite, []).append(spec.name)
        return out

    def check_names(self, names: Iterable[str], where: str) -> None:
        """Raise UnknownTaskError naming ``where`` for any kiln_* name that is not registered."""
        for name in names:
            if name.startswith(LOCAL_PREFIX):
                try:
                    self.get(name)
                except UnknownTaskError as e:
                    raise UnknownTaskError(f"{where}: {e}") from None

    def check_suites(self, suites: Mapping[str, Iterable[str]]) -> None:
        """Raise naming the suite and task when a suite lists a kiln_* task that is not registered."""
        for suite, tasks in suites.items():
            self.check_names(tasks, f"suite {suite!r}")

    def standard(self) -> list[str]:
        """lm-eval's own tasks with a known chance baseline (the standard benchmarks among them)."""
        return list(dict.fromkeys([*self._standard, *self._benchmarks]))

    def chance_table(self) -> ChanceTable:
        return ChanceTable(self)


class ChanceTable(Mapping):
    """{task: chance} over a registry as it is now: local tasks, then lm-eval's own listed ones."""

    def __init__(self, registry: TaskRegistry):
        self.registry = registry

    def __getitem__(self, name: str) -> float | None:
        if name.removesuffix(CLEAN_SUFFIX) not in set(self):
            raise KeyError(name)
        return self.registry.chance(name)

    def get(self, name: str, default: float | None = None) -> float | None:
        """The chance of a task; ``default`` for one of lm-eval's not listed; an unknown kiln_* task raises."""
        if name.startswith(LOCAL_PREFIX):
            return self.registry.chance(name)
        return self[name] if name.removesuffix(CLEAN_SUFFIX) in self.registry.standard() else default

    def __iter__(self) -> Iterator[str]:
        return iter([*(s.name for s in self.registry.local()), *self.registry.standard()])

    def __len__(self) -> int:
        return len(list(iter(self)))


REGISTRY = TaskRegistry(LOCAL_TASKS, STANDARD_CHANCE, BENCHMARKS)


def main() -> int:
    for spec in REGISTRY.local():
        print(f"{spec.name}\tchance {spec.chance}\tprimary {spec.primary}\tsuite {spec.suite}\t"
              f"items {type(spec.items).__name__}\t{spec.lm_eval['output_type']}")
    for b in map(REGISTRY.benchmark, REGISTRY.benchmark_names()):
        print(f"{b.name}\tlm-eval {b.yaml} v{b.version}\tchance {b.chance}\tprimary {b.primary}\titems {b.rows}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
