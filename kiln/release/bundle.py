"""Release bundle: safetensors weights and tokenizer files in the Hugging Face layout of the model's family (GPT-2,
Llama, Qwen3), GGUF files for llama.cpp (llama family: F16, Q8_0), config, card, kiln.json, checksums.

Use: ``write_release(checkpoint, out_dir, card, extra, files)`` (files: the card's plots and the run config); ``load_release(dir)`` reads it back (``kiln generate DIR``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from safetensors.torch import load_file, save_file

from kiln.common.files import atomic_path, atomic_write_bytes, atomic_write_json, atomic_write_text, sha256_file
from kiln.model.config import ModelConfig
from kiln.model.families import build_model
from kiln.release.hf import ReleaseError, from_hf_state_dict, hf_config, to_hf_state_dict, write_hf_tokenizer
from kiln.train.checkpoint import load_state, resolve_checkpoint

__all__ = ["RELEASE_FORMAT", "ReleaseError", "is_release", "load_release", "verify_release", "write_release"]

RELEASE_FORMAT = "kiln-release/1"


def write_release(checkpoint: str | Path, out_dir: Path, card: str, extra: dict[str, Any] | None = None,
                  files: Mapping[str, bytes] | None = None, gguf_types: Sequence[str] = (), name: str = "",
                  license: str = "") -> dict[str, Any]:
    """Write the bundle into ``out_dir`` (which must be a fresh staging folder); return its manifest.

    ``extra`` goes into kiln.json beside what the checkpoint says (model, step, tokenizer); the sections
    ``lineage_tree`` renders are listed in kiln.release.lineage.LINEAGE_SECTIONS. ``files``: more files by name
    (the card's plots, the run config), written beside the card and listed in SHA256SUMS. ``gguf_types``: a
    ``model-<type>.gguf`` of each (kiln.release.gguf; for a family GGUF cannot hold, the reason is recorded instead).
    The card gets a Files section: every file, its kind, bytes and sha256.
    """
    ckpt = resolve_checkpoint(checkpoint)
    state, meta = load_state(ckpt)
    cfg = ModelConfig(**meta["model"])
    from kiln.tokens.tokenizer import encoding_fingerprint, load_encoding

    enc = load_encoding(ckpt / "tokenizer.json")
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_dir / "model.safetensors") as tmp:
        save_file(to_hf_state_dict(state["model"], cfg), str(tmp), metadata={"format": "pt"})
    atomic_write_json(out_dir / "config.json", hf_config(cfg, enc.eot_token))
    atomic_write_json(out_dir / "generation_config.json", {
        "bos_token_id": enc.eot_token, "eos_token_id": enc.eot_token, "pad_token_id": enc.eot_token, "do_sample": True,
        "temperature": 0.8, "top_k": 50, "max_new_tokens": 128,
    })
    atomic_write_bytes(out_dir / "tokenizer.kiln.json", (ckpt / "tokenizer.json").read_bytes())
    hf_files = write_hf_tokenizer(enc, out_dir, cfg.block_size)
    gguf = _write_ggufs(state["model"], cfg, enc, out_dir, gguf_types, name, license)
    atomic_write_json(out_dir / "kiln.json", {
        "format": RELEASE_FORMAT, "model": meta["model"], "source_checkpoint": str(ckpt), "step": meta["step"],
        "task": meta.get("task"), "checkpoint_val_loss": meta.get("val_loss"),
        "tokenizer": {"name": enc.name, "n_vocab": enc.n_vocab, "fingerprint": encoding_fingerprint(enc),
                      "pattern": enc._pat_str, "special_tokens": enc._special_tokens, "hf_files": hf_files},
        "gguf": gguf, **(extra or {}),
    })
    for fname, data in (files or {}).items():
        if "/" in fname or fname in ("README.md", "kiln.json", "SHA256SUMS", "model.safetensors") or fname.endswith(".gguf"):
            raise ReleaseError(f"write_release: extra file name {fname!r} is a path or one of the bundle's own files")
        atomic_write_bytes(out_dir / fname, data)
    atomic_write_text(out_dir / "README.md", card + files_section(out_dir, gguf))
    files = {p.name: sha256_file(p) for p in sorted(out_dir.iterdir()) if p.is_file() and p.name != "SHA256SUMS"}
    atomic_write_text(out_dir / "SHA256SUMS", "".join(f"{h}  {n}\n" for n, h in files.items()))
    return {"files": files, "bytes": sum((out_dir / n).stat().st_size for n in files), "checkpoint": str(ckpt),
            "gguf": gguf}


def _write_ggufs(state: dict, cfg: ModelConfig, enc, out_dir: Path, types: Sequence[str], name: str,
                 license: str) -> dict[str, Any]:
    """{"files": [what write_gguf returned, per type]} or {"skipped": why} when the family has no GGUF layout."""
    from kiln.release.gguf import gguf_architecture, write_gguf
    from kiln.release.hf import CHAT_TEMPLATE

    if not types:
        return {"files": []}
    try:
        gguf_architecture(cfg)
    except ReleaseError as e:
        return {"files": [], "skipped": str(e)}
    from kiln.tokens.tokenizer import chat_template

    return {"files": [write_gguf(state, cfg, enc, out_dir / f"model-{t}.gguf", t,
                                 chat_template=chat_template(enc) or CHAT_TEMPLATE,
                                 name=name, license=license) for t in types]}


FILE_KINDS = {".safetensors": "weights (Hugging Face layout)", ".gguf": "weights (GGUF, llama.cpp)",
              ".png": "figure", ".yaml": "run config", ".md": "this card"}


def files_section(out_dir: Path, gguf: dict[str, Any]) -> str:
    """The card's list of every file in the bundle (but the card and SHA256SUMS): kind, bytes, sha256."""
    types = {g["file"]: f"GGUF {g['type']} ({', '.join(f'{k} {v}' for k, v in g['tensor_types'].items())})"
             for g in gguf.get("files", [])}
    rows = []
    for p in sorted(out_dir.iterdir()):
        if not p.is_file() or p.name in ("README.md", "SHA256SUMS"):
            continue
        kind = types.get(p.name) or FILE_KINDS.get(p.suffix) or ("tokenizer" if "token" in p.name or p.name in (
            "vocab.json", "merges.txt") else "config")
        rows.append(f"| {p.name} | {kind} | {p.stat().st_size:,} | `{sha256_file(p)}` |")
    skipped = f"\nNo GGUF file: {gguf['skipped']}\n" if gguf.get("skipped") else ""
    return ("\n## Files\n`sha256sum -c SHA256SUMS` checks them all. The GGUF files run in llama.cpp, "
            "Ollama and LM Studio, with the chat template in their metadata.\n\n| file | what | bytes | sha256 |\n"
            "|---|---|---:|---|\n" + "\n".join(rows) + "\n" + skipped)


def is_release(path: str | Path) -> bool:
    """Whether ``path`` is a release bundle, whole or damaged: it holds the bundle's record (kiln.json) or its
    checksums (SHA256SUMS). Readers then load it with load_release, which names what is missing or wrong."""
    p = Path(path)
    return (p / "SHA256SUMS").is_file() or (p / "kiln.json").is_file()


# what write_release writes: a sha256, two spaces, and the name of a file in the bundle's folder (no path)
SUMS_LINE = re.compile(r"([0-9a-f]{64})  ((?!\.\.?$)[^/]+)")
REWRITE = "copy the whole bundle folder again, or write it again with the release_bundle asset"


def verify_release(bundle: Path) -> None:
    """Check every file listed in SHA256SUMS; raise ReleaseError naming the first that differs, or the line of
    SHA256SUMS that is not a checksum and a file name."""
    bundle = Path(bundle)
    sums = bundle / "SHA256SUMS"
    if not sums.is_file():
        raise ReleaseError(f"{sums}: missing, so nothing in {bundle} can be verified; {REWRITE}")
    try:
        lines = sums.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ReleaseError(f"{sums}: not UTF-8 text ({e.reason} at byte {e.start}); the checksum list is damaged: "
                           f"{REWRITE}") from e
    entries = []
    for n, line in enumerate(lines, 1):
        m = SUMS_LINE.fullmatch(line)
        if m is None:
            raise ReleaseError(f"{sums}: line {n} is not '<sha256>  <file name>' (got {line[:80]!r}); the checksum "
                               f"list is damaged: {REWRITE}")
        entries.append(m.groups())
    if not entries:
        raise ReleaseError(f"{sums}: lists no files; {REWRITE}")
    for digest, name in entries:
        if not (bundle / name).is_file():
            raise ReleaseError(f"{bundle / name}: listed in SHA256SUMS but missing; the bundle is incomplete")
        if sha256_file(bundle / name) != digest:
            raise ReleaseError(f"{bundle / name}: checksum does not match SHA256SUMS; the bundle is damaged")


def load_release(bundle: str | Path, map_location: str = "cpu"):
    """(model of the bundle's family in eval mode, tokenizer) from a release bundle, after verifying its checksums."""
    from kiln.tokens.tokenizer import load_encoding

    bundle = Path(bundle)
    verify_release(bundle)
    info = json.loads((bundle / "kiln.json").read_text())
    cfg = ModelConfig(**info["model"])
    model = build_model(cfg)
    model.load_state_dict(from_hf_state_dict(load_file(str(bundle / "model.safetensors"), device=map_location), cfg))
    model.eval()
    return model, load_encoding(bundle / "tokenizer.kiln.json")
