"""Tests of kiln/release/lineage.py: kiln.json keeps the lineage and its tree shows every section (long lists truncated
unless full), a checkpoint's lineage follows init_from, and the release sections record every upstream version and run."""

from __future__ import annotations

import json
from dataclasses import asdict

from kiln.release.bundle import write_release
from kiln.release.lineage import LINEAGE_SECTIONS, checkpoint_lineage, lineage_tree, read_release_info
from kiln.train.checkpoint import save_checkpoint
from tests.kiln.release.test_release import CFG, UPSTREAM, checkpoint  # noqa: F401  (checkpoint is a fixture)

LINEAGE_EXTRA = {
    "name": "kiln-test",
    "lineage": {"raw_documents": "aaaa1111", "clean_corpus": "bbbb2222", "tokenizer": "cccc3333", "token_shards": "dddd4444",
                "base_model": "eeee5555", "eval_scores": "ffff6666", "sft_model": "9999aaaa"},
    "sources": [{"name": "python-docs", "kind": "pip", "package": "sphinx", "version": "8.1.0", "sha256": "ab" * 32,
                 "license": "BSD-2-Clause", "documents": 120}],
    "filters": {"min_words": 20, "max_symbol_ratio": 0.1, "minhash_threshold": 0.8},
    "corpus": {"input_docs": 200, "kept_docs": 150, "dedup_rate": 0.1, "removed": {"too_short": 30, "near_duplicate": 20}},
    "training": {"base_model": {"steps": 30, "tokens": 3840, "initial_val_loss": 5.7, "final_val_loss": 3.2}},
    "eval": {"val_bits_per_byte": 1.9, "cloze.acc": 0.41, "cloze.chance": 0.25},
    "post_training": [{"stage": "sft", "version": "9999aaaa", "examples": 80}],
    "mlflow_runs": {"base_model": "run-base", "sft_model": "run-sft"},
    "configs": {"clean_corpus": {"min_words": 20}},
}


def test_kiln_json_keeps_lineage_and_the_tree_shows_every_section(tmp_path, checkpoint) -> None:
    ckpt, _ = checkpoint
    write_release(ckpt, tmp_path / "release", card="card", extra=LINEAGE_EXTRA)
    info = read_release_info(tmp_path / "release")
    assert info["format"] == "kiln-release/1" and info["release"] == str(tmp_path / "release")
    for k, v in LINEAGE_EXTRA.items():
        assert info[k] == v, k
    assert info["tokenizer"]["n_vocab"] == 300 and len(info["tokenizer"]["fingerprint"]) == 64
    tree = lineage_tree(info)
    for needle in ("release kiln-test", f"from checkpoint {ckpt}", "lineage:", "clean_corpus: bbbb2222",
                   "- python-docs: documents=120, kind=pip,", "package=sphinx", "minhash_threshold: 0.8",
                   "near_duplicate: 20", "base_model:", "final_val_loss: 3.2", "cloze.acc: 0.41",
                   "- sft: examples=80, version=9999aaaa", "sft_model: run-sft", "tokenizer: kiln-bpe-300 (300 tokens"):
        assert needle in tree, (needle, tree)
    assert set(LINEAGE_SECTIONS) >= {"lineage", "sources", "filters", "eval", "mlflow_runs"}


def test_lineage_tree_truncates_long_lists_unless_full() -> None:
    info = {"release": "/r", "name": "x", "sources": [{"name": f"s{i}", "version": "1"} for i in range(20)]}
    short, full = lineage_tree(info), lineage_tree(info, full=True)
    assert "... 8 more" in short and "- s19" not in short
    assert "- s19: version=1" in full and "more" not in full


def test_checkpoint_lineage_follows_init_from(tmp_path, checkpoint) -> None:
    ckpt, m = checkpoint
    base_job = ckpt.parent.parent / "job.json"
    base_job.write_text(json.dumps({"task": "pretrain", "train_files": ["/s/token_shards/dddd4444/train_000.bin"],
                                    "tokenizer": "/s/tokenizer/cccc3333/tokenizer.json", "mlflow_run_id": "run-base"}))
    sft = save_checkpoint(tmp_path / "sft" / "checkpoints", 3, {"model": m.state_dict()}, {"model": asdict(CFG), "task": "sft"},
                          extra_files={"tokenizer.json": ckpt / "tokenizer.json"})
    (tmp_path / "sft" / "job.json").write_text(json.dumps({"task": "sft", "init_from": str(ckpt), "mlflow_run_id": "run-sft",
                                                           "train_files": ["/s/instruction_data/77/pairs.jsonl"]}))
    info = checkpoint_lineage(sft)
    assert info["task"] == "sft" and info["mlflow_runs"] == {"sft": "run-sft"}
    assert info["init_from"]["checkpoint"] == str(ckpt) and info["init_from"]["mlflow_runs"] == {"pretrain": "run-base"}
    tree = lineage_tree(info)
    assert f"checkpoint {sft} (step 3, task sft" in tree and "fine-tuned from:" in tree
    assert "/s/token_shards/dddd4444/train_000.bin" in tree and "/s/instruction_data/77/pairs.jsonl" in tree


def test_release_sections_record_every_upstream_version_and_run() -> None:
    from kiln.release.lineage import LINEAGE_ASSETS, lineage_versions, release_sections

    scores = {"val_bits_per_byte": 1.8765, "kiln_continuation.acc": 0.41}
    info = release_sections("kiln-test", "Apache-2.0", UPSTREAM, scores, {"release_bundle": {"name": "kiln-test"}})
    assert set(info) <= set(LINEAGE_SECTIONS) | {"name", "license"}
    assert info["lineage"] == lineage_versions(UPSTREAM) and list(info["lineage"]) == list(LINEAGE_ASSETS)
    assert "training_plan" not in info["lineage"] and info["lineage"]["rl_model"] == "rl1"
    assert info["mlflow_runs"] == {"base_model": "run-base", "sft_model": "run-sft", "dpo_model": "run-dpo", "rl_model": "run-rl"}
    assert info["sources"] == [{"name": "python-docs", "kind": "pip", "documents": 120}, {"name": "notes", "kind": "local", "documents": 3}]
    assert info["corpus"] == {"input_docs": 1234, "kept_docs": 1184, "kept_bytes": 3456789, "dedup_rate": 0.0162,
                              "removed": {"too_short": 30, "near_duplicate": 20}}
    assert info["plan"] == {k: v for k, v in UPSTREAM["training_plan"].items() if k not in ("tokens_per_param", "memory_gb")}
    assert info["training"] == {"base_model": {"version": "eeee5555", "steps": 30, "tokens": 122880, "initial_val_loss": 5.7,
                                               "final_val_loss": 3.21, "wall_s": 12.5, "checkpoint": "/s/base/step_30"}}
    assert info["post_training"] == [{"stage": "sft", "version": "9999aaaa", "steps": 20}, {"stage": "dpo", "version": "dpo1", "steps": 10},
                                     {"stage": "rl", "version": "rl1", "steps": 8}]
    assert info["eval"] == {**scores, "uniform_loss": 5.70378} and info["tokens"] == {"train": 1234567, "val": 45678}
