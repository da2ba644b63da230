"""Tests for kiln.release.load: a path is taken as it is, a registry reference (models:/NAME@ALIAS or
models:/NAME/VERSION) is resolved to its local bundle folder or is a ValueError saying what to give, and a release
bundle or a checkpoint loads as its model, tokenizer and chat template (a template file first, then the bundle's, an
imported checkpoint's, the tokenizer's own, else Kiln's). The registry's get_release is replaced by a dict of releases.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from kiln.model.config import ModelConfig, padded_vocab
from kiln.model.families import build_model
from kiln.release.bundle import write_release
from kiln.release.hf import CHAT_TEMPLATE
from kiln.release.load import load_any_model, load_chat_model, resolve_reference
from kiln.tokens.tokenizer import load_encoding, save_encoding, with_chat_template
from kiln.train.checkpoint import save_checkpoint, weights_digest

OWN_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
TRACKING = "sqlite:///registry.db"


@pytest.fixture
def registry(monkeypatch):
    """Registered releases by (name, version or alias): kiln.release.registry.get_release answers from this dict,
    raising LookupError as it does for what is not there; the calls it got are kept under "calls"."""
    from kiln.release import registry as module

    known: dict = {"calls": []}

    def get_release(tracking_uri, name, which):
        known["calls"].append((tracking_uri, name, which))
        if (name, which) not in known:
            raise LookupError(f"model {name!r} in {tracking_uri}: no alias {which!r}")
        return known[name, which]

    monkeypatch.setattr(module, "get_release", get_release)
    return known


def release(bundle_dir: str, source: str, version: str = "1"):
    from kiln.release.registry import ReleaseVersion

    return ReleaseVersion(name="kiln", version=version, source=source, run_id=None, bundle=bundle_dir, digest="d" * 64,
                          previous=None)


def checkpoint(tmp_path: Path, tok_path: Path, seed: int = 0, **meta) -> tuple[Path, torch.nn.Module]:
    enc = load_encoding(tok_path)
    cfg = ModelConfig(vocab_size=padded_vocab(enc.n_vocab), block_size=16, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(seed)
    model = build_model(cfg)
    ckpt = save_checkpoint(tmp_path / f"run{seed}" / "checkpoints", 5, {"model": model.state_dict()},
                           {"model": asdict(cfg), **meta}, extra_files={"tokenizer.json": tok_path})
    return ckpt, model


def bundle(tmp_path: Path, tok_path: Path, seed: int = 0) -> tuple[Path, torch.nn.Module]:
    ckpt, model = checkpoint(tmp_path, tok_path, seed)
    out = tmp_path / f"release{seed}"
    write_release(ckpt, out, card=f"# release {seed}\n")
    return out, model


def templated_tokenizer(tmp_path: Path, tok_path: Path) -> Path:
    """A copy of the tokenizer that carries OWN_TEMPLATE."""
    out = tmp_path / "templated" / "tokenizer.json"
    out.parent.mkdir()
    save_encoding(with_chat_template(load_encoding(tok_path), OWN_TEMPLATE), out)
    return out


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return weights_digest(a.state_dict()) == weights_digest(b.state_dict())


def test_a_path_is_taken_as_it_is(tmp_path, registry):
    assert resolve_reference(str(tmp_path / "release"), TRACKING) == (tmp_path / "release", None)
    assert registry["calls"] == []  # no registry was asked


@pytest.mark.parametrize("ref", ["models:/kiln", "models:/kiln@", "models:/@candidate", "models:/kiln/", "models:/"])
def test_a_malformed_reference_says_how_to_write_one(ref, registry):
    with pytest.raises(ValueError) as e:
        resolve_reference(ref, TRACKING)
    assert str(e.value) == f"{ref!r}: write a registered model as models:/NAME@ALIAS or models:/NAME/VERSION"
    assert registry["calls"] == []


def test_a_reference_is_resolved_by_alias_or_version_to_its_bundle(tmp_path, registry, tiny_tokenizer):
    _, tok = tiny_tokenizer
    folder, _ = bundle(tmp_path, tok)
    registry["kiln", "candidate"] = registry["kiln", "1"] = rel = release(str(folder), folder.as_uri())
    assert resolve_reference("models:/kiln@candidate", TRACKING) == (folder, rel)
    assert resolve_reference("models:/kiln/1", TRACKING) == (folder, rel)
    assert registry["calls"] == [(TRACKING, "kiln", "candidate"), (TRACKING, "kiln", "1")]
    with pytest.raises(ValueError) as e:
        resolve_reference("models:/kiln@prod", TRACKING)
    assert str(e.value) == f"models:/kiln@prod: model 'kiln' in {TRACKING}: no alias 'prod'"
    assert isinstance(e.value.__cause__, LookupError)


def test_a_bundle_that_moved_is_found_at_the_versions_source_or_named(tmp_path, registry, tiny_tokenizer):
    _, tok = tiny_tokenizer
    folder, _ = bundle(tmp_path, tok, seed=1)
    registry["kiln", "logged"] = release(str(tmp_path / "gone"), folder.as_uri())  # logged to a run: its copy
    assert resolve_reference("models:/kiln@logged", TRACKING)[0] == folder
    registry["kiln", "2"] = rel = release(str(tmp_path / "gone"), "mlflow-artifacts:/1/abc/artifacts/release", "2")
    with pytest.raises(ValueError) as e:
        resolve_reference("models:/kiln/2", TRACKING)
    assert str(e.value) == (f"models:/kiln/2 is version 2 with source {rel.source}, which is not a local bundle "
                            "folder; download it with mlflow artifacts download and pass the folder")
    shutil.rmtree(folder)
    with pytest.raises(ValueError, match="models:/kiln@logged is version 1 with source file://"):
        resolve_reference("models:/kiln@logged", TRACKING)


def test_a_release_bundle_loads_with_its_tokenizer_and_template(tmp_path, tiny_tokenizer):
    enc, tok = tiny_tokenizer
    folder, model = bundle(tmp_path, tok, seed=2)
    loaded, got_enc, template = load_chat_model(folder)
    assert same_weights(loaded, model) and not loaded.training
    assert got_enc.encode_ordinary("the cat sees a dog") == enc.encode_ordinary("the cat sees a dog")
    assert template == CHAT_TEMPLATE  # tokenizer_config.json's: Kiln's own for a Kiln tokenizer
    templated, _ = bundle(tmp_path / "own", templated_tokenizer(tmp_path, tok), seed=2)
    assert load_chat_model(templated)[2] == OWN_TEMPLATE
    model_only, enc_only = load_any_model(folder)
    assert same_weights(model_only, model) and enc_only.n_vocab == enc.n_vocab


def test_a_checkpoint_loads_with_the_template_of_its_tokenizer_or_of_its_import(tmp_path, tiny_tokenizer):
    _, tok = tiny_tokenizer
    ckpt, model = checkpoint(tmp_path, tok, seed=3)
    loaded, _, template = load_chat_model(ckpt)
    assert same_weights(loaded, model) and template == CHAT_TEMPLATE
    assert same_weights(load_any_model(ckpt.parent.parent)[0], model)  # the run folder: its latest checkpoint
    own, _ = checkpoint(tmp_path / "own", templated_tokenizer(tmp_path, tok), seed=3)
    assert load_chat_model(own)[2] == OWN_TEMPLATE
    imported, _ = checkpoint(tmp_path / "imported", tok, seed=3, task="import",
                             pretrained={"gguf": {"chat_template": "GGUF {{ messages }}"}})
    assert load_chat_model(imported)[2] == "GGUF {{ messages }}"
    pretrain, _ = checkpoint(tmp_path / "pretrain", tok, seed=3, task="pretrain",
                             pretrained={"gguf": {"chat_template": "ignored"}})
    assert load_chat_model(pretrain)[2] == CHAT_TEMPLATE  # only an import carries a template of its own
    file = tmp_path / "template.jinja"
    file.write_text("FILE {{ messages }}")
    assert load_chat_model(imported, template_file=str(file))[2] == "FILE {{ messages }}"
