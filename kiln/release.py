"""Release writer: safetensors weights in the Hugging Face GPT-2 layout, config, tokenizer, card, checksums.

``load_release(dir)`` reads a bundle back into a Kiln GPT (used by tests and ``kiln generate``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kiln.checkpoint import load_state, resolve_checkpoint
from kiln.model import GPT, GPTConfig
from kiln.storage import atomic_path, atomic_write_json, atomic_write_text, sha256_file

# Hugging Face's GPT-2 stores these projections as Conv1D, whose weight is the transpose of nn.Linear's.
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def to_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Kiln parameter names already follow GPT2LMHeadModel; transpose Conv1D weights, drop the tied head."""
    out = {}
    for name, t in state.items():
        if name == "lm_head.weight":
            continue  # tied to transformer.wte.weight
        t = t.detach().to(torch.float32)
        out[name] = (t.t() if name.endswith(CONV1D) else t).contiguous()
    return out


def from_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {name: (t.t() if name.endswith(CONV1D) else t).contiguous() for name, t in state.items()}
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def hf_config(cfg: GPTConfig, eot: int) -> dict[str, Any]:
    if not cfg.bias:
        raise ValueError("Hugging Face GPT-2 needs biases: release a model trained with model.bias=true")
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size, "n_ctx": cfg.block_size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer,
        "n_head": cfg.n_head, "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
        "bos_token_id": eot, "eos_token_id": eot, "tie_word_embeddings": True, "torch_dtype": "float32",
    }


def write_release(checkpoint: str | Path, out_dir: Path, card: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the bundle into ``out_dir`` (which must be a fresh staging folder); return its manifest."""
    ckpt = resolve_checkpoint(checkpoint)
    state, meta = load_state(ckpt)
    cfg = GPTConfig(**meta["model"])
    from kiln.tokenizer import load_encoding

    enc = load_encoding(ckpt / "tokenizer.json")
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_dir / "model.safetensors") as tmp:
        save_file(to_hf_state_dict(state["model"]), str(tmp), metadata={"format": "pt"})
    atomic_write_json(out_dir / "config.json", hf_config(cfg, enc.eot_token))
    atomic_write_json(out_dir / "generation_config.json", {
        "bos_token_id": enc.eot_token, "eos_token_id": enc.eot_token, "do_sample": True,
        "temperature": 0.8, "top_k": 50, "max_new_tokens": 128,
    })
    shutil.copyfile(ckpt / "tokenizer.json", out_dir / "tokenizer.kiln.json")
    atomic_write_json(out_dir / "kiln.json", {"model": meta["model"], "source_checkpoint": str(ckpt),
                                              "step": meta["step"], **(extra or {})})
    atomic_write_text(out_dir / "README.md", card)
    files = {p.name: sha256_file(p) for p in sorted(out_dir.iterdir()) if p.is_file() and p.name != "SHA256SUMS"}
    atomic_write_text(out_dir / "SHA256SUMS", "".join(f"{h}  {n}\n" for n, h in files.items()))
    return {"files": files, "bytes": sum((out_dir / n).stat().st_size for n in files), "checkpoint": str(ckpt)}


def verify_release(bundle: Path) -> None:
    """Check every file listed in SHA256SUMS; raise ValueError naming the first that differs."""
    for line in (bundle / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ", 1)
        if not (bundle / name).is_file():
            raise ValueError(f"{bundle / name}: listed in SHA256SUMS but missing; the bundle is incomplete")
        if sha256_file(bundle / name) != digest:
            raise ValueError(f"{bundle / name}: checksum does not match SHA256SUMS; the bundle is damaged")


def load_release(bundle: str | Path, map_location: str = "cpu"):
    """(GPT in eval mode, tokenizer) from a release bundle, after verifying its checksums."""
    from kiln.tokenizer import load_encoding

    bundle = Path(bundle)
    verify_release(bundle)
    info = json.loads((bundle / "kiln.json").read_text())
    model = GPT(GPTConfig(**info["model"]))
    model.load_state_dict(from_hf_state_dict(load_file(str(bundle / "model.safetensors"), device=map_location)))
    model.eval()
    return model, load_encoding(bundle / "tokenizer.kiln.json")
