"""Tests of kiln/evaluation/suite.py: the suite's scores for random and cheating models, and lm-eval's command line
loading a checkpoint as model kiln."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.evaluation import TASK_NAMES, KilnLM, build_tasks, run_suite
from tests.kiln.evaluation.evaluation_kit import NGramLM, enc, make_docs, tiny_gpt  # noqa: F401  (enc is a fixture)


def test_run_suite_random_and_cheating_models(tmp_path, enc):
    docs = make_docs(60, seed=1)
    info = build_tasks(docs, tmp_path, n_items=40, seed=0)
    model = tiny_gpt(block_size=64, seed=1).train()
    res = run_suite(model, enc, tmp_path, list(TASK_NAMES), batch_size=8)
    assert model.training  # mode restored
    assert set(res["kiln_heldout_ppl"]) == {"word_perplexity", "byte_perplexity", "bits_per_byte", "chance", "items"}
    assert set(res["kiln_continuation"]) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "chance", "items"}
    assert set(res["kiln_lastword"]) == {"acc", "acc_stderr", "perplexity", "perplexity_stderr", "chance", "items"}
    assert all(res[t]["items"] == 40 and res[t]["chance"] == info[t]["chance"] for t in TASK_NAMES)
    accs = [res["kiln_continuation"]["acc"]]
    for s in (2, 3):
        accs.append(run_suite(tiny_gpt(64, seed=s), enc, tmp_path, ["kiln_continuation"])["kiln_continuation"]["acc"])
    assert 0.1 <= sum(accs) / 3 <= 0.4  # random models: near chance 0.25 (sd ~0.04 over 3 x 40 items)
    assert 0 <= res["kiln_lastword"]["acc"] <= 1 and res["kiln_heldout_ppl"]["bits_per_byte"] > 6  # ~log2(257)
    json.dumps(res)

    # A model that memorised each passage with its true ending must mostly pick it: checks labels end to end.
    # (Not 1.0: a distractor may be another item's memorised ending.)
    rows = [json.loads(line) for line in Path(info["kiln_continuation"]["data"]).read_text().splitlines()]
    cheat_lm = NGramLM([enc.encode(r["context"] + " " + r["choices"][r["label"]]) for r in rows])
    cheat = run_suite(cheat_lm, enc, tmp_path, ["kiln_continuation"], limit=25)
    assert cheat["kiln_continuation"]["items"] == 25 and cheat["kiln_continuation"]["acc"] >= 0.8


def test_lm_eval_command_line_loads_a_checkpoint_as_model_kiln(tmp_path, enc, capsys):
    """``kiln-lm-eval --model kiln --model_args checkpoint=...`` (lm-eval's own CLI with the model registered)."""
    from dataclasses import asdict

    from kiln.train.checkpoint import save_checkpoint
    from kiln.evaluation import lm_eval_cli
    from kiln.tokens.tokenizer import save_encoding

    model = tiny_gpt(block_size=64, seed=6)
    save_encoding(enc, tmp_path / "tokenizer.json")
    ckpt = save_checkpoint(tmp_path / "run" / "checkpoints", 5, {"model": model.state_dict()},
                           {"model": asdict(model.config)}, {"tokenizer.json": tmp_path / "tokenizer.json"})
    build_tasks(make_docs(30, seed=2), tmp_path / "tasks", n_items=6, seed=0)
    out = tmp_path / "out"
    lm_eval_cli(["--model", "kiln", "--model_args", f"checkpoint={tmp_path / 'run'},batch_size=4",
                 "--tasks", "kiln_continuation", "--include_path", str(tmp_path / "tasks"), "--output_path", str(out)])
    (result,) = out.rglob("results_*.json")
    got = json.loads(result.read_text())["results"]["kiln_continuation"]
    lm = KilnLM(model, enc, batch_size=4)  # the same checkpoint in code gives the same accuracy
    ref = run_suite(lm.model, enc, tmp_path / "tasks", ["kiln_continuation"], batch_size=4)
    assert got["acc,none"] == ref["kiln_continuation"]["acc"] and str(ckpt).endswith("step_0000005")
