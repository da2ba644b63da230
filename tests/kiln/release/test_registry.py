"""Tests for kiln.release.registry: release bundles as MLflow model versions with an alias, scores and lineage tags, and the
previous release found again for a regression check. MLflow runs on a sqlite file in a temporary folder.

Run: python -m pytest tests/kiln/release/test_registry.py -q
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from kiln.train.checkpoint import save_checkpoint
from kiln.model.config import ModelConfig
from kiln.model.gpt2.model import GPT
from kiln.release.registry import (
    TAG_DIGEST,
    bundle_digest,
    compare_scores,
    flat_scores,
    get_release,
    previous_release,
    register_release,
    register_unless_regressed,
    tag_key,
)
from kiln.release.bundle import write_release

CFG = ModelConfig(vocab_size=320, block_size=16, n_layer=1, n_head=2, n_embd=16)
LINEAGE = {"clean_corpus": "bbbb2222", "token_shards": "dddd4444", "sft_model": "9999aaaa"}


@pytest.fixture(scope="module")
def tracking(tmp_path_factory) -> tuple[str, Path]:
    """(tracking URI of a sqlite store, its artifact root), shared by the tests (each uses its own model name)."""
    root = tmp_path_factory.mktemp("mlflow")
    return f"sqlite:///{root / 'mlflow.db'}", root / "artifacts"


def make_bundle(tmp_path: Path, tok_path: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    m = GPT(CFG)
    ckpt = save_checkpoint(tmp_path / f"run{seed}" / "checkpoints", 5, {"model": m.state_dict()}, {"model": asdict(CFG)},
                           extra_files={"tokenizer.json": tok_path})
    bundle = tmp_path / f"release{seed}"
    write_release(ckpt, bundle, card=f"# release {seed}\n")
    return bundle


def new_run(uri: str, artifacts: Path) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("kiln") or None
    exp_id = exp.experiment_id if exp else client.create_experiment("kiln", artifact_location=artifacts.resolve().as_uri())
    return client.create_run(exp_id).info.run_id


def test_register_two_releases_then_find_the_previous_one_and_its_regressions(tmp_path, tracking, tiny_tokenizer) -> None:
    from mlflow.tracking import MlflowClient

    uri, artifacts = tracking
    _, tok = tiny_tokenizer
    first, second = make_bundle(tmp_path, tok, 0), make_bundle(tmp_path, tok, 1)
    run1 = new_run(uri, artifacts)
    assert previous_release(uri, "kiln-a", "candidate") is None  # no model registered yet

    s1 = {"val_loss": 3.0, "val_bits_per_byte": 1.5, "cloze.acc,none": 0.40, "cloze.acc_stderr,none": 0.05}
    v1 = register_release(uri, "kiln-a", first, scores=s1, lineage=LINEAGE, run_id=run1)
    assert (v1.name, v1.version, v1.previous, v1.run_id) == ("kiln-a", "1", None, run1)
    assert v1.scores == s1 and v1.lineage == LINEAGE and v1.aliases == ["candidate"]
    assert v1.digest == bundle_digest(first) and v1.bundle == str(first.resolve())
    assert v1.source.startswith("file://") and v1.source.endswith("/release")
    logged = Path(v1.source[len("file://"):])
    assert (logged / "SHA256SUMS").read_bytes() == (first / "SHA256SUMS").read_bytes()  # the bundle is in the run
    assert (logged / "model.safetensors").stat().st_size == (first / "model.safetensors").stat().st_size

    client = MlflowClient(uri)
    tags = client.get_model_version("kiln-a", "1").tags
    assert tags[tag_key("cloze.acc,none")] == "0.4" and tag_key("cloze.acc,none") == "kiln.score.cloze.acc_none"
    assert tags["kiln.lineage.token_shards"] == "dddd4444" and tags[TAG_DIGEST] == v1.digest
    assert previous_release(uri, "kiln-a", "candidate").version == "1"
    assert previous_release(uri, "kiln-a", "candidate", exclude_version="1") is None  # the first release has none

    s2 = {"val_loss": 3.2, "val_bits_per_byte": 1.4, "cloze.acc,none": 0.35, "cloze.acc_stderr,none": 0.01}
    v2 = register_release(uri, "kiln-a", second, scores=s2, lineage={**LINEAGE, "sft_model": "new"}, run_id=new_run(uri, artifacts))
    assert (v2.version, v2.previous, v2.aliases) == ("2", "1", ["candidate"])
    assert str(client.get_model_version_by_alias("kiln-a", "candidate").version) == "2"
    prev = previous_release(uri, "kiln-a", "candidate", exclude_version=v2.version)
    assert prev.version == "1" and prev.scores == s1 and prev.lineage["sft_model"] == "9999aaaa"

    found = compare_scores(v2.scores, prev.scores)
    assert [(r.metric, r.previous, r.current, r.lower_is_better) for r in found] == [
        ("cloze.acc,none", 0.40, 0.35, False), ("val_loss", 3.0, 3.2, True)]  # bits/byte improved; stderr not compared
    assert "val_loss: 3 -> 3.2 (lower is better)" in [str(r) for r in found]
    assert compare_scores(v2.scores, prev.scores, tolerance=0.25) == []


def test_registering_the_same_bundle_again_returns_its_version(tmp_path, tracking, tiny_tokenizer) -> None:
    uri, artifacts = tracking
    _, tok = tiny_tokenizer
    bundle = make_bundle(tmp_path, tok, 2)
    a = register_release(uri, "kiln-b", bundle, scores={"val_loss": 2.0}, run_id=new_run(uri, artifacts))
    b = register_release(uri, "kiln-b", bundle, scores={"val_loss": 2.0}, run_id=new_run(uri, artifacts), alias="champion")
    assert a.version == b.version == "1" and set(b.aliases) == {"candidate", "champion"}
    assert get_release(uri, "kiln-b", "champion").version == "1" and get_release(uri, "kiln-b", "1").scores == {"val_loss": 2.0}
    with pytest.raises(LookupError, match="no alias 'prod'"):
        get_release(uri, "kiln-b", "prod")


def test_without_a_run_the_source_is_the_bundle_folder(tmp_path, tracking, tiny_tokenizer) -> None:
    uri, _ = tracking
    _, tok = tiny_tokenizer
    bundle = make_bundle(tmp_path, tok, 3)
    v = register_release(uri, "kiln-c", bundle, set_alias=False)
    assert v.source == bundle.resolve().as_uri() and v.run_id is None and v.aliases == []
    assert previous_release(uri, "kiln-c", "candidate") is None


def test_a_regressed_release_is_registered_without_moving_the_alias(tmp_path, tracking, tiny_tokenizer) -> None:
    uri, _ = tracking
    _, tok = tiny_tokenizer
    good = register_release(uri, "kiln-e", make_bundle(tmp_path, tok, 5), scores={"val_loss": 2.0})
    bad = register_release(uri, "kiln-e", make_bundle(tmp_path, tok, 6), scores={"val_loss": 2.5}, set_alias=False)
    assert (good.version, bad.version, bad.previous, bad.aliases) == ("1", "2", "1", [])
    assert get_release(uri, "kiln-e", "candidate").version == "1"
    prev = previous_release(uri, "kiln-e", "candidate", exclude_version=bad.version)
    assert prev.version == "1" and [r.metric for r in compare_scores(bad.scores, prev.scores)] == ["val_loss"]


def test_register_unless_regressed_moves_the_alias_only_when_nothing_got_worse(tmp_path, tracking, tiny_tokenizer) -> None:
    uri, _ = tracking
    _, tok = tiny_tokenizer
    first, prev, regressions = register_unless_regressed(uri, "kiln-f", make_bundle(tmp_path, tok, 7), {"val_loss": 2.0},
                                                         LINEAGE, None, tolerance=0.1)
    assert (first.version, prev, regressions, first.aliases) == ("1", None, [], ["candidate"])
    worse, prev, regressions = register_unless_regressed(uri, "kiln-f", make_bundle(tmp_path, tok, 8), {"val_loss": 2.5},
                                                         LINEAGE, None, tolerance=0.1)
    assert (worse.version, prev.version, worse.aliases) == ("2", "1", [])
    assert regressions == ["val_loss: 2 -> 2.5 (lower is better)"] and worse.lineage == LINEAGE
    assert get_release(uri, "kiln-f", "candidate").version == "1"
    close, prev, regressions = register_unless_regressed(uri, "kiln-f", make_bundle(tmp_path, tok, 9), {"val_loss": 2.05},
                                                         LINEAGE, None, tolerance=0.1)
    assert (close.version, prev.version, regressions, close.aliases) == ("3", "1", [], ["candidate"])


def test_a_stage_that_made_a_measure_worse_beyond_noise_keeps_the_alias_where_it_was(tmp_path, tracking,
                                                                                     tiny_tokenizer) -> None:
    from kiln.release.registry import released_scores, stage_regressions

    rows = [{"measure": "preference_accuracy", "before": 0.75, "after": 0.653, "change": -0.097, "stderr": 0.034,
             "beyond_noise": True},
            {"measure": "response_loss", "before": 2.5, "after": 2.592, "change": 0.092, "stderr": 0.01, "beyond_noise": True},
            {"measure": "response_token_accuracy", "before": 0.5, "after": 0.49, "change": -0.01, "stderr": 0.01,
             "beyond_noise": False},  # worse, within noise
            {"measure": "arithmetic_answer_logprob", "before": -4.0, "after": -3.0, "change": 1.0, "stderr": 0.1,
             "beyond_noise": True}]  # better beyond noise
    refusals = stage_regressions("ppo_model", "sft_model", rows)
    assert refusals == [
        "ppo_model made preference_accuracy worse than sft_model, beyond noise (2 paired SE): 0.7500 -> 0.6530 "
        "(-0.097 ± 0.034 *)",
        "ppo_model made response_loss worse than sft_model, beyond noise (2 paired SE): 2.5000 -> 2.5920 (+0.092 ± 0.010 *)"]
    assert released_scores({"after": {"response_loss": 2.592}}) == {"released.response_loss": 2.592}
    tiny = {"measure": "arithmetic_answer_logprob", "before": -4.0, "after": -4.001, "change": -0.001, "stderr": 0.0002,
            "beyond_noise": True}  # beyond noise, yet smaller than the tolerance: no regression
    assert stage_regressions("rl_model", "dpo_model", [tiny], tolerance=0.02) == []
    assert stage_regressions("ppo_model", "sft_model", rows, tolerance=0.02) == refusals
    uri, _ = tracking
    _, tok = tiny_tokenizer
    first, _, _ = register_unless_regressed(uri, "kiln-s", make_bundle(tmp_path, tok, 5), {"val_loss": 2.0}, LINEAGE, None)
    held, prev, regressions = register_unless_regressed(uri, "kiln-s", make_bundle(tmp_path, tok, 6),
                                                        {"val_loss": 2.0, "released.response_loss": 2.592}, LINEAGE,
                                                        None, refusals=refusals)
    assert regressions == refusals and held.aliases == [] and prev.version == first.version
    assert get_release(uri, "kiln-s", "candidate").version == first.version
    # The next release is compared with the alias holder on the released weights' own measures as well.
    worse, _, regressions = register_unless_regressed(uri, "kiln-s", make_bundle(tmp_path, tok, 7),
                                                      {"val_loss": 2.0, "released.response_loss": 2.7}, LINEAGE, None)
    assert regressions == [] and worse.aliases == ["candidate"]  # the holder (version 1) has no released.* score
    _, _, regressions = register_unless_regressed(uri, "kiln-s", make_bundle(tmp_path, tok, 8),
                                                  {"val_loss": 2.0, "released.response_loss": 2.9}, LINEAGE, None,
                                                  tolerance=0.1)
    assert regressions == ["released.response_loss: 2.7 -> 2.9 (lower is better)"]


def test_a_damaged_bundle_is_not_registered(tmp_path, tracking, tiny_tokenizer) -> None:
    uri, _ = tracking
    _, tok = tiny_tokenizer
    bundle = make_bundle(tmp_path, tok, 4)
    (bundle / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"config\.json: checksum does not match"):
        register_release(uri, "kiln-d", bundle)


def test_flat_scores_from_an_eval_scores_output() -> None:
    out = {"checkpoint": "/x", "step": 30, "val_loss": 3.1, "val_bits_per_byte": 1.7, "uniform_loss": 5.7,
           "tasks": {"cloze": {"acc,none": 0.5, "acc_stderr,none": 0.1, "items": 40, "alias": "cloze"}}}
    assert flat_scores(out) == {"val_loss": 3.1, "val_bits_per_byte": 1.7, "uniform_loss": 5.7,
                                "cloze.acc,none": 0.5, "cloze.acc_stderr,none": 0.1, "cloze.items": 40.0}
    assert compare_scores({"uniform_loss": 9.0, "cloze.items": 1.0}, {"uniform_loss": 1.0, "cloze.items": 40.0}) == []
