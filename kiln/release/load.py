"""Any model Kiln made or imported, loaded for inference: a release bundle, a checkpoint (folder, checkpoints root or
run folder) or a GGUF file, with its tokenizer and chat template; a registry reference (``models:/NAME@ALIAS``)
resolved to its bundle folder. What ``kiln generate``, ``kiln chat``, ``kiln arena`` and the benches load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def resolve_reference(ref: str, tracking_uri: str) -> tuple[Path, Any]:
    """(folder, registered version or None) from a path, or from a registry reference ``models:/NAME@ALIAS`` or
    ``models:/NAME/VERSION``; a reference that is malformed, unknown or not a local bundle is a ValueError saying
    what to give instead."""
    if not ref.startswith("models:/"):
        return Path(ref), None
    from kiln.release.registry import get_release

    name, sep, which = ref[len("models:/"):].partition("@")
    if not sep:
        name, _, which = name.partition("/")
    if not name or not which:
        raise ValueError(f"{ref!r}: write a registered model as models:/NAME@ALIAS or models:/NAME/VERSION")
    try:
        rel = get_release(tracking_uri, name, which)
    except Exception as e:  # LookupError, or MlflowException for an unknown model or version
        raise ValueError(f"{ref}: {e}") from e
    from kiln.release.bundle import is_release

    for where in (rel.bundle, rel.source[len("file://"):] if rel.source.startswith("file://") else ""):
        if where and is_release(where):
            return Path(where), rel
    raise ValueError(f"{ref} is version {rel.version} with source {rel.source}, which is not a local bundle folder; "
                     "download it with mlflow artifacts download and pass the folder")


def load_any_model(path: str | Path):
    """A release bundle, a checkpoint (folder, checkpoints root or run folder) or a GGUF file -> (model, tokenizer)."""
    model, enc, _ = load_chat_model(path)
    return model, enc


def load_chat_model(path: str | Path, template_file: str = ""):
    """(model, tokenizer, chat template) of a release bundle, a checkpoint or a GGUF file. The template: ``template_file``'s
    text; else a bundle's tokenizer_config.json's; a GGUF's own; an imported checkpoint's (from its GGUF); the one its
    encoding carries; else Kiln's."""
    from kiln.pretrained.gguf import is_gguf
    from kiln.release.bundle import is_release, load_release
    from kiln.release.hf import CHAT_TEMPLATE

    p = Path(path)
    template = ""
    if is_release(p):
        model, enc = load_release(p)
        conf = p / "tokenizer_config.json"
        template = json.loads(conf.read_text()).get("chat_template", "") if conf.is_file() else ""
    elif is_gguf(p):
        from kiln.model.families import build_model
        from kiln.pretrained.source import load_pretrained

        state, cfg, tok, record = load_pretrained(p)
        model = build_model(cfg)
        model.load_state_dict(state)
        model.eval()
        enc, template = tok.encoding, record["gguf"]["chat_template"]
    else:
        from kiln.train.checkpoint import load_for_inference

        model, enc, meta = load_for_inference(p)
        if meta.get("task") == "import":
            template = ((meta.get("pretrained") or {}).get("gguf") or {}).get("chat_template", "")
    from kiln.tokens.tokenizer import chat_template

    if template_file:
        template = Path(template_file).read_text()
    return model, enc, template or chat_template(enc) or CHAT_TEMPLATE
