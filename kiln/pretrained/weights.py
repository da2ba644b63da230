"""Safetensors weights of a Hugging Face folder mapped onto Kiln's model, every name and shape checked.

``read_weights(folder)`` reads model.safetensors or the shards named by model.safetensors.index.json (never a pickle);
``kiln_state(folder, cfg, tensors)`` renames, transposes and checks them against ``build_model(cfg)``;
``grow_vocab(state, cfg, ids, mean_of)`` gives tokens added to the tokenizer rows initialised to the mean embedding.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from kiln.model.config import ModelConfig
from kiln.model.families import build_model, of
from kiln.pretrained.config import PretrainedError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth", "model.ckpt", "tf_model.h5",
           "flax_model.msgpack")


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files holding the weights: model.safetensors, or every shard the index names (each checked)."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        try:
            names = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise PretrainedError(f"{folder / INDEX}: unreadable ({type(e).__name__}: {e}); re-download the model") from e
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise PretrainedError(f"{folder / missing[0]}: shard named in {INDEX} is missing "
                                  f"({len(missing)} of {len(names)} missing); download every shard")
        return [folder / n for n in names]
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    pickles = [n for n in PICKLES if (folder / n).is_file()]
    if pickles:
        raise PretrainedError(f"{folder / pickles[0]}: a pickle checkpoint, which Kiln never loads (unpickling runs "
                              f"code); convert it to safetensors (model.save_pretrained(folder, safe_serialization=True))"
                              f" or download the model's {SINGLE}")
    raise PretrainedError(f"{folder}: no {SINGLE} or {INDEX}; a Hugging Face model folder holds its weights in safetensors")


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, as float32, by name (no pickle is read)."""
    from safetensors import SafetensorError, safe_open

    out: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    out[name] = f.get_tensor(name).to(torch.float32)
        except (SafetensorError, OSError) as e:
            raise PretrainedError(f"{path}: not a readable safetensors file ({e}); re-download it") from e
    return out


def kiln_state(folder: Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict of ``build_model(cfg)`` from the folder's tensors; a missing, extra or misshapen weight is an
    error naming the tensor, the shapes and config.json."""
    desc = of(cfg)
    state = desc.from_hf(tensors, cfg)  # the renaming release's bundles are read back with (kiln.model.families)
    with torch.device("meta"):
        template = build_model(cfg).state_dict()
    where = f"{Path(folder)} (config.json against its safetensors)"
    missing = sorted(set(template) - set(state))
    if missing:
        raise PretrainedError(f"{where}: weight {missing[0]!r} missing ({len(missing)} missing); the safetensors do "
                              "not hold the model config.json describes")
    extra = sorted(set(state) - set(template))
    if extra:
        raise PretrainedError(f"{where}: unexpected weight {extra[0]!r} ({len(extra)} unexpected); the architecture "
                              "differs from what config.json says, so it is not imported")
    for name, t in template.items():
        if tuple(state[name].shape) != tuple(t.shape):
            hint = " (this family's Hugging Face files store it transposed)" if name.endswith(desc.adapter.transposed) else ""
            raise PretrainedError(f"{where}: {name} has shape {tuple(state[name].shape)} but config.json implies "
                                  f"{tuple(t.shape)}{hint}; config.json and the weights disagree")
    return state


def grown_config(cfg: ModelConfig, new_ids: list[int]) -> ModelConfig:
    """``cfg`` with an embedding long enough for the token ids ``new_ids`` (the rows grow_vocab adds)."""
    return replace(cfg, vocab_size=max(cfg.vocab_size, max(new_ids) + 1)) if new_ids else cfg


def grow_vocab(state: dict[str, torch.Tensor], cfg: ModelConfig, new_ids: list[int], mean_of: int) -> tuple[dict, ModelConfig]:
    """Embedding (and untied head) rows for tokens added to the tokenizer (``new_ids``), each the mean of the first
    ``mean_of`` rows (the imported tokenizer's own tokens), so a new token starts as an average one; the embedding
    grows when an id is past its last row."""
    if not new_ids:
        return state, cfg
    new_cfg = grown_config(cfg, new_ids)
    out = dict(state)
    desc = of(cfg)
    emb, tied = desc.parts.embedding, desc.parts.tied(cfg)
    for key in [emb] if tied else [emb, desc.parts.head]:
        w = state[key]  # (V, C)
        grown = torch.cat([w, w.new_zeros(new_cfg.vocab_size - w.shape[0], w.shape[1])], dim=0)  # (V_new, C)
        grown[new_ids] = w[:mean_of].mean(dim=0)
        out[key] = grown.contiguous()
    if tied:
        out[desc.parts.head] = out[emb]
    return out, new_cfg
