"""Fixtures of the standard benchmark tests: arc_easy registered with 3 items, every benchmark prepared from the real
package (full) and the parity comparison of Kiln's adapter with lm-eval's HFLM (parity); each built once for the folder."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kiln.evaluation.registry import REGISTRY
from kiln.evaluation.standard.run import load_tasks, prepare
from tests.kiln.evaluation.standard.standard_kit import CONVERTED, GEN_TOKS, MAX_LENGTH, NAMES


@pytest.fixture
def three_item_arc():
    """arc_easy registered with 3 items (the hand-built package's), restored afterwards."""
    saved = REGISTRY.snapshot()
    REGISTRY._benchmarks["arc_easy"] = replace(REGISTRY.benchmark("arc_easy"), rows=3)
    yield
    REGISTRY.restore(saved)


@pytest.fixture(scope="package")
def full(source_cache, tmp_path_factory):
    """Every benchmark written from the real package (all items); lm-eval's tasks of the converted ones loaded."""
    prepared = prepare(NAMES, source_cache, tmp_path_factory.mktemp("standard"))
    return prepared, load_tasks(replace(prepared, names=CONVERTED))


@pytest.fixture(scope="package")
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
