"""A GGUF file (llama.cpp's format: Ollama's, LM Studio's and most released quantised models') read as the parts of a
Hugging Face folder, so the import path that checks a folder checks it too.

``read_gguf(path)`` gives a ``GgufModel``: config.json's fields (``config``), tokenizer.json (``tokenizer``), every weight
dequantised to float32 under its Hugging Face name (``tensors``), and what lineage shows (``record``: the file's sha256,
size, architecture, quantisation types by count, licence, chat template). ``kiln.pretrained.source.load_pretrained``
takes a ``.gguf`` path as it takes a folder.

The reading and dequantising are the ``gguf`` package's (llama.cpp's own Python reader). What is written here by hand is
the way back to Hugging Face's layout, which no library exposes outside transformers' loader: the tensor names (looked
up in ``gguf``'s own name map), the query/key row order llama.cpp's converter permutes for its RoPE kernel, undone, the
config keys, and the pre-tokenizer that llama.cpp names (``tokenizer.ggml.pre``) as a tokenizer.json node. A GGUF that
is truncated, has the wrong magic or version, an architecture no Kiln family computes, tensors whose shapes disagree
with its metadata, or no tokenizer metadata is refused with the file and the field named.
"""

from __future__ import annotations

import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.common.files import sha256_file
from kiln.pretrained.config import PretrainedError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # the GGUF versions the gguf reader reads (llama.cpp writes 3)
# GGUF architecture -> (the Hugging Face model_type whose config.json reader takes it, whether llama.cpp's converter
# permuted the query and key rows of each head for its RoPE kernel, which Kiln's half-split rotation undoes)
ARCHITECTURES = {"llama": ("llama", True), "qwen3": ("qwen3", False)}
# tokenizer.ggml.pre (llama.cpp's name for how text is split before BPE) -> the tokenizer.json pre_tokenizer that
# splits the same way (kiln.pretrained.tokenizer.split_pattern reads these three shapes)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _byte_level(use_regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _split(regex: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}, _byte_level(False)]}


PRE_TOKENIZERS = {
    "gpt-2": _byte_level(True),
    "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _byte_level(True)]},
    **{name: _split(LLAMA3_SPLIT) for name in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3")},
    **{name: _split(QWEN2_SPLIT) for name in ("qwen2", "deepseek-r1-qwen", "megrez")},
}
CONTROL, USER_DEFINED, UNUSED = 3, 4, 5  # gguf.TokenType values: special tokens, added plain tokens, padding rows


@dataclass
class GgufModel:
    """What a GGUF holds, in a Hugging Face folder's terms."""

    path: Path
    config: dict[str, Any]  # config.json's fields
    tokenizer: dict[str, Any]  # tokenizer.json
    tensors: dict[str, torch.Tensor] = field(repr=False)  # Hugging Face weight name -> float32 tensor
    record: dict[str, Any] = field(default_factory=dict)  # lineage: sha256, size, architecture, types, licence, template


def is_gguf(path: str | os.PathLike) -> bool:
    """True for a file that starts with GGUF's magic (whatever its name)."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            return p.is_file() and f.read(4) == MAGIC
    except OSError:
        return False


def check_header(path: Path) -> int:
    """The GGUF version of ``path``; PretrainedError when the file is missing, too short, or not GGUF 2 or 3."""
    if not path.is_file():
        raise PretrainedError(f"{path}: no such file; give the .gguf file's path")
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24:
        raise PretrainedError(f"{path}: {len(head)} bytes, shorter than a GGUF header (24); the file is truncated: "
                              "download it again")
    if head[:4] != MAGIC:
        raise PretrainedError(f"{path}: magic {head[:4]!r} is not {MAGIC!r}; not a GGUF file")
    version = struct.unpack("<I", head[4:8])[0]
    if version not in VERSIONS:
        raise PretrainedError(f"{path}: GGUF version {version} is not supported (Kiln reads versions "
                              f"{', '.join(map(str, VERSIONS))}); convert it again with a current llama.cpp")
    return version


def _reader(path: Path):
    from gguf import GGUFReader

    check_header(path)
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, IndexError, struct or numpy errors on a damaged file
        raise PretrainedError(f"{path}: not a readable GGUF ({type(e).__name__}: {e}); the file is truncated or "
                              "damaged: download it again") from e
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise PretrainedError(f"{path}: tensor data ends at byte {end} but the file has {path.stat().st_size}; "
                              "the file is truncated: download it again")
    return reader


class _Fields:
    """The metadata of one reader, each read once, a missing key an error naming the file and the key."""

    def __init__(self, reader, path: Path):
        self.reader, self.path = reader, path

    def get(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            return default
        try:
            return f.contents()
        except Exception as e:
            raise PretrainedError(f"{self.path}: metadata {key} is unreadable ({e}); the file is damaged") from e

    def need(self, key: str, what: str) -> Any:
        value = self.get(key)
        if value is None:
            raise PretrainedError(f"{self.path}: metadata {key} is missing ({what}); the file cannot be imported")
        return value


def _config(meta: _Fields, arch: str, n_tokens: int, tied: bool) -> dict[str, Any]:
    """config.json of the Hugging Face model the GGUF was converted from, from its ``{arch}.*`` metadata."""
    path = meta.path
    model_type = ARCHITECTURES[arch][0]
    n_embd = int(meta.need(f"{arch}.embedding_length", "the model width"))
    n_head = int(meta.need(f"{arch}.attention.head_count", "attention heads"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", n_embd // n_head))
    rope_dim = meta.get(f"{arch}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise PretrainedError(f"{path}: metadata {arch}.rope.dimension_count={rope_dim} rotates part of each head "
                              f"({head_dim} wide); Kiln's RoPE rotates whole heads, so it is not imported")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise PretrainedError(f"{path}: metadata {arch}.rope.scaling.type={scaling!r}: scaled RoPE is not supported "
                              "(Kiln's Llama has plain RoPE)")
    doc = {
        "model_type": model_type, "architectures": [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]],
        "vocab_size": int(meta.get(f"{arch}.vocab_size", n_tokens)),
        "max_position_embeddings": int(meta.need(f"{arch}.context_length", "the context length")),
        "num_hidden_layers": int(meta.need(f"{arch}.block_count", "the number of layers")),
        "hidden_size": n_embd, "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", n_head)),
        "intermediate_size": int(meta.need(f"{arch}.feed_forward_length", "the MLP width")),
        "rms_norm_eps": float(meta.need(f"{arch}.attention.layer_norm_rms_epsilon", "the RMSNorm epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)), "hidden_act": "silu",
        "tie_word_embeddings": tied, "attention_bias": False, "mlp_bias": False,
    }
    if model_type == "qwen3":
        doc["head_dim"] = head_dim
    elif head_dim != n_embd // n_head:
        raise PretrainedError(f"{path}: metadata {arch}.attention.key_length={head_dim} is not embedding_length / "
                              f"head_count ({n_embd // n_head}); Kiln's Llama cannot hold it")
    if meta.get("general.license"):
        doc["license"] = str(meta.get("general.license"))
    return doc


def _tokenizer(meta: _Fields) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tokenizer.json of a byte-level BPE GGUF vocabulary, what the record says of it). Control tokens become
    special added tokens, user-defined ones plain added tokens, unused (padding) rows are left out."""
    path = meta.path
    kind = meta.need("tokenizer.ggml.model", "the tokenizer type; a GGUF without it carries no tokenizer")
    if kind != "gpt2":
        raise PretrainedError(f"{path}: metadata tokenizer.ggml.model={kind!r} is not supported; Kiln imports "
                              "byte-level BPE vocabularies ('gpt2': GPT-2, Llama 3, Qwen, SmolLM), not SentencePiece")
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise PretrainedError(f"{path}: metadata tokenizer.ggml.pre={pre!r} is not supported; Kiln splits text as "
                              f"{', '.join(sorted(PRE_TOKENIZERS))}")
    tokens = list(meta.need("tokenizer.ggml.tokens", "the vocabulary"))
    merges = list(meta.need("tokenizer.ggml.merges", "the BPE merges"))
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise PretrainedError(f"{path}: metadata tokenizer.ggml.token_type has {len(types)} entries for "
                              f"{len(tokens)} tokens; the file is damaged")
    vocab = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty != UNUSED}
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": ty == CONTROL} for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (CONTROL, USER_DEFINED)]
    doc = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
           "pre_tokenizer": PRE_TOKENIZERS[pre], "post_processor": None,
           "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                     "vocab": vocab, "merges": merges}}
    ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")}
    info = {"model": kind, "pre": pre, "tokens": len(tokens), "merges": len(merges),
            "unused": sum(ty == UNUSED for ty in types), **{f"{k}_token": tokens[i] for k, i in ids.items()
                                                            if i is not None and 0 <= int(i) < len(tokens)}}
    return doc, info


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of llama.cpp's converter's ``permute``: each head's rows back from interleaved pairs (its RoPE
    kernel's order) to two halves (Hugging Face's rotate_half order)."""
    rows = w.shape[0] // n_head // 2
    return w.reshape(n_head, rows, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _hf_names(arch: str, n_layer: int, names: list[str]) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name for every Hugging Face name in ``names``, from gguf's own name map."""
    import gguf

    arch_id = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    table = gguf.get_tensor_name_map(arch_id, n_layer)
    out = {}
    for hf in names:
        g = table.get_name(hf, try_suffixes=(".weight", ".bias"))
        if g is not None:
            out[g] = hf
    return out


def _tensors(reader, meta: _Fields, arch: str, cfg: dict[str, Any]) -> tuple[dict[str, torch.Tensor], Counter]:
    """Every weight dequantised to float32 under its Hugging Face name, its shape checked against the metadata."""
    from gguf import dequantize

    from kiln.model.families import build_model, of
    from kiln.pretrained.config import model_config_of

    path = meta.path
    kcfg = model_config_of(path, cfg)
    with torch.device("meta"):
        template = of(kcfg).to_hf(build_model(kcfg).state_dict(), kcfg)  # the Hugging Face names and shapes expected
    names = _hf_names(arch, cfg["num_hidden_layers"], list(template))
    permuted = ARCHITECTURES[arch][1]
    out, types = {}, Counter()
    for t in reader.tensors:
        hf = names.get(t.name)
        if hf is None:
            raise PretrainedError(f"{path}: tensor {t.name} has no place in a {arch} model of this metadata (rope "
                                  "frequency tables, biases and extra heads are not supported); not imported")
        want = tuple(template[hf].shape)
        got = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions fastest first
        if got != want:
            raise PretrainedError(f"{path}: tensor {t.name} has shape {got} but the metadata ({arch}.* keys) implies "
                                  f"{want}; the tensors and the metadata disagree")
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(got)
        except Exception as e:
            raise PretrainedError(f"{path}: tensor {t.name} ({t.tensor_type.name}) cannot be dequantised ({e})") from e
        if permuted and hf.endswith("self_attn.q_proj.weight"):
            w = _unpermute(w, cfg["num_attention_heads"])
        elif permuted and hf.endswith("self_attn.k_proj.weight"):
            w = _unpermute(w, cfg["num_key_value_heads"])
        out[hf] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # a copy: F32 data is the file's memory map
        types[t.tensor_type.name] += 1
    missing = sorted(set(template) - set(out) - ({"lm_head.weight"} if cfg["tie_word_embeddings"] else set()))
    if missing:
        raise PretrainedError(f"{path}: no tensor for {missing[0]} ({len(missing)} missing); the file does not hold "
                              f"the model its metadata describes")
    return out, types


def read_gguf(path: str | os.PathLike, weights: bool = True) -> GgufModel:
    """The config, tokenizer, float32 weights and lineage record of a GGUF file (see the module docstring);
    ``weights=False`` reads the metadata alone (no tensor is dequantised, ``tensors`` is empty)."""
    path = Path(path)
    reader = _reader(path)
    meta = _Fields(reader, path)
    arch = meta.need("general.architecture", "which model the file holds")
    if arch not in ARCHITECTURES:
        raise PretrainedError(f"{path}: metadata general.architecture={arch!r} is not supported; Kiln imports "
                              f"{', '.join(ARCHITECTURES)} (the GGUF architectures its model families compute)")
    tokenizer, tok_info = _tokenizer(meta)
    tied = all(t.name != "output.weight" for t in reader.tensors)
    config = _config(meta, arch, tok_info["tokens"], tied)
    tensors, types = _tensors(reader, meta, arch, config) if weights else ({}, Counter(t.tensor_type.name for t in reader.tensors))
    record = {
        "file": path.name, "sha256": sha256_file(path), "bytes": path.stat().st_size,
        "gguf_version": check_header(path),
        "architecture": arch, "name": meta.get("general.name", ""), "license": meta.get("general.license", ""),
        "tensor_types": dict(sorted(types.items())), "file_type": meta.get("general.file_type"),
        "tokenizer": tok_info, "chat_template": meta.get("tokenizer.chat_template", ""),
    }
    return GgufModel(path, config, tokenizer, tensors, record)
