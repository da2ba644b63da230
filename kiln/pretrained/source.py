"""Released weights imported whole: a Hugging Face folder or a GGUF file (kiln.pretrained.gguf), its model config,
weights, tokenizer, content hash and licence, written as a Kiln checkpoint (``checkpoints/step_0000000``) that any
training stage can start from.

``import_pretrained(source, out_dir)`` returns the record that lineage and the model card show; ``python -m
kiln.pretrained SOURCE OUT`` does the same from a shell.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable

from kiln.common.files import atomic_write_json, manifest_of_dir, stable_hash
from kiln.model.config import ModelConfig, model_dict
from kiln.model.families import build_model
from kiln.pretrained.config import PretrainedError, model_config, model_config_of
from kiln.pretrained.gguf import GgufModel, is_gguf, read_gguf
from kiln.pretrained.tokenizer import ImportedTokenizer, check_same_ids, encoding_from_hf
from kiln.common.files import sha256_file
from kiln.pretrained.weights import grow_vocab, grown_config, kiln_state, read_weights, weight_files

IMPORT_FORMAT = "kiln-pretrained/1"
LICENSE_FILES = ("LICENSE", "LICENSE.txt", "LICENSE.md", "LICENCE", "COPYING")


def is_hf_folder(path: str | Path) -> bool:
    """True for a folder in the Hugging Face layout (config.json, no Kiln checkpoint meta.json)."""
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and not (p / "meta.json").is_file()


def is_importable(path: str | Path) -> bool:
    """True for what ``import_pretrained`` takes: a Hugging Face folder or a GGUF file."""
    return is_hf_folder(path) or is_gguf(path)


def folder_hash(folder: Path) -> str:
    """sha256 over every file's relative path, size and sha256 (hidden files such as .cache/ left out); a GGUF
    file's own sha256."""
    return sha256_file(Path(folder)) if is_gguf(folder) else stable_hash(manifest_of_dir(Path(folder)))


def licence_of(folder: Path, config: dict[str, Any]) -> str:
    """The licence a folder declares: README.md front matter ``license:``, config.json ``license``, or the name of a
    LICENSE file; "unknown" when none says."""
    readme = Path(folder) / "README.md"
    if readme.is_file():
        text = readme.read_text(errors="replace")
        front = re.match(r"^---\s*\n(.*?)\n---\s*\n", text, re.S)
        found = re.search(r"^license:\s*['\"]?([^'\"\n]+?)['\"]?\s*$", front.group(1), re.M) if front else None
        if found:
            return found.group(1).strip()
    if config.get("license"):
        return str(config["license"])
    for name in LICENSE_FILES:
        if (Path(folder) / name).is_file():
            return f"see {name}"
    return "unknown"


def _check_vocab(folder: Path, tok: ImportedTokenizer, cfg: ModelConfig) -> None:
    if tok.imported_vocab > cfg.vocab_size:
        raise PretrainedError(f"{folder / 'tokenizer.json'}: {tok.imported_vocab} tokens but the embedding in "
                              f"{folder / 'config.json'} has {cfg.vocab_size} rows (vocab_size); the tokenizer does "
                              "not belong to these weights")


def _config_and_tokenizer(folder: Path) -> tuple[ModelConfig, dict[str, Any], ImportedTokenizer]:
    """(ModelConfig of config.json, the raw config.json, the imported tokenizer) of a folder, checked to belong together."""
    if not folder.is_dir():
        raise PretrainedError(f"{folder}: not a folder; give the Hugging Face model's local folder "
                              "(huggingface-cli download NAME --local-dir FOLDER makes one)")
    from kiln.tokens.tokenizer import with_end_token

    cfg, doc = model_config(folder)
    tok = encoding_from_hf(folder / "tokenizer.json", name=f"hf-{folder.name}")
    _check_vocab(folder, tok, cfg)
    with_end_token(tok.encoding, hf_eos_token(folder))
    return cfg, doc, tok


def hf_eos_token(folder: Path) -> str | None:
    """The end-of-sequence token a Hugging Face folder's tokenizer_config.json names (transformers' eos_token), or
    None."""
    import json

    try:
        eos = json.loads((folder / "tokenizer_config.json").read_text()).get("eos_token")
    except (OSError, ValueError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos if isinstance(eos, str) else None


def _gguf_parts(path: Path, weights: bool) -> tuple[GgufModel, ModelConfig, ImportedTokenizer]:
    """(the GGUF read, its ModelConfig, its imported tokenizer), checked to belong together."""
    from kiln.tokens.tokenizer import with_chat_template, with_end_token

    g = read_gguf(path, weights=weights)
    cfg = model_config_of(path, g.config)
    tok = encoding_from_hf(path, name=f"gguf-{path.stem}", doc=g.tokenizer)
    with_chat_template(tok.encoding, g.record["chat_template"])  # post-training and chat use the model's own
    with_end_token(tok.encoding, g.record["tokenizer"].get("eos_token"))  # tokenizer.ggml.eos_token_id's token
    if tok.imported_vocab > cfg.vocab_size:
        raise PretrainedError(f"{path}: metadata tokenizer.ggml.tokens has {tok.imported_vocab} tokens but the "
                              f"embedding has {cfg.vocab_size} rows; the tokenizer does not belong to these weights")
    return g, cfg, tok


def pretrained_architecture(folder: str | Path) -> tuple[ModelConfig, ImportedTokenizer]:
    """The ModelConfig that training on an imported folder or GGUF file uses (its config, with the embedding grown
    for Kiln's added chat tokens as load_pretrained grows it) and the imported tokenizer, from the config and the
    tokenizer alone: no weights are read (``kiln plan`` sizes a run with it)."""
    folder = Path(folder)
    if is_gguf(folder):
        _, cfg, tok = _gguf_parts(folder, weights=False)
    else:
        cfg, _, tok = _config_and_tokenizer(folder)
    return grown_config(cfg, tok.new_ids), tok


def _load_gguf(path: Path, texts: Iterable[str]) -> tuple[dict, ModelConfig, ImportedTokenizer, dict]:
    g, cfg, tok = _gguf_parts(path, weights=True)
    checked = check_same_ids(tok, path, texts, doc=g.tokenizer)
    state = kiln_state(path, cfg, g.tensors)
    state, cfg = grow_vocab(state, cfg, tok.new_ids, tok.imported_vocab)
    record = {
        "format": IMPORT_FORMAT, "source": str(path.resolve()), "sha256": g.record["sha256"],
        "license": g.record["license"] or "unknown", "model_type": g.config["model_type"],
        "architectures": g.config["architectures"], "weights": [path.name],
        "imported_vocab": tok.imported_vocab, "added_tokens": tok.added, "tokenizer_notes": tok.notes,
        "tokenizer_texts_checked": checked, "model": model_dict(cfg), "gguf": g.record,
    }
    return state, cfg, tok, record


def load_pretrained(folder: str | Path, texts: Iterable[str] = ()) -> tuple[dict, ModelConfig, ImportedTokenizer, dict]:
    """(Kiln state dict, its ModelConfig, the imported tokenizer, the record) of a Hugging Face folder or a GGUF file.
    Each chat token added to the tokenizer gets an embedding row set to the mean of the imported rows (the embedding
    grows if needed)."""
    folder = Path(folder)
    if is_gguf(folder):
        return _load_gguf(folder, texts)
    if folder.is_file() and folder.suffix.lower() == ".gguf":
        from kiln.pretrained.gguf import check_header

        check_header(folder)  # names what is wrong with a file called .gguf that is not one
    cfg, doc, tok = _config_and_tokenizer(folder)
    files = weight_files(folder)
    checked = check_same_ids(tok, folder / "tokenizer.json", texts)
    state = kiln_state(folder, cfg, read_weights(folder))
    state, cfg = grow_vocab(state, cfg, tok.new_ids, tok.imported_vocab)
    record = {
        "format": IMPORT_FORMAT, "source": str(folder.resolve()), "sha256": folder_hash(folder),
        "license": licence_of(folder, doc), "model_type": doc.get("model_type"),
        "architectures": doc.get("architectures") or [], "weights": [p.name for p in files],
        "imported_vocab": tok.imported_vocab, "added_tokens": tok.added, "tokenizer_notes": tok.notes,
        "tokenizer_texts_checked": checked, "model": model_dict(cfg),
    }
    return state, cfg, tok, record


def import_pretrained(folder: str | Path, out_dir: str | Path, texts: Iterable[str] = ()) -> dict[str, Any]:
    """Write ``out_dir``/tokenizer.json (Kiln's encoding), ``checkpoints/step_0000000`` (the weights as a Kiln
    checkpoint whose meta records the source) and pretrained.json (paths relative to ``out_dir``); return the record
    with absolute paths."""
    from kiln.tokens.tokenizer import encoding_fingerprint, save_encoding
    from kiln.train.checkpoint import save_checkpoint, weights_digest

    state, cfg, tok, record = load_pretrained(folder, texts)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_encoding(tok.encoding, out / "tokenizer.json")
    build_model(cfg).load_state_dict(state)  # the checkpoint loads into the model it names
    meta = {"model": model_dict(cfg), "task": "import", "val_loss": None, "pretrained": record,
            "weights_digest": weights_digest(state)}
    ckpt = save_checkpoint(out / "checkpoints", 0, {"model": state}, meta,
                           extra_files={"tokenizer.json": out / "tokenizer.json"}, keep_last=1)
    record = {**record, "n_vocab": tok.encoding.n_vocab, "eot": tok.encoding.eot_token,
              "fingerprint": encoding_fingerprint(tok.encoding)}
    atomic_write_json(out / "pretrained.json", {**record, "checkpoint": str(ckpt.relative_to(out)),
                                                "tokenizer": "tokenizer.json"})  # relative: the folder may move
    return {**record, "checkpoint": str(ckpt), "tokenizer": str(out / "tokenizer.json")}
