"""A release's weights as GGUF, the file llama.cpp, Ollama and LM Studio run: F16 or Q8_0 (norms in F32), with the
tokenizer and the chat template in its metadata, written with the ``gguf`` package's own writer and quantiser.

``write_gguf(state, cfg, enc, path, "Q8_0", chat_template=..., name=..., license=...)`` returns what the card lists
of the file (type, tensor types by count, bytes, sha256). Families whose layout llama.cpp runs: llama (Llama,
Mistral) and Qwen3 (``gguf_architecture`` says which, or why not).

Written by hand (llama.cpp's converter reads a Hugging Face folder and is not a library): the metadata keys, the
query/key row order llama.cpp's RoPE kernel expects for llama (its converter's ``permute``), and the split pattern's
llama.cpp name (``tokenizer.ggml.pre``), chosen only where llama.cpp's pre-tokenizer of that name splits as Kiln's
pattern does. The names come from gguf's own tensor name map; the quantisation is gguf's.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.common.files import atomic_path, sha256_file
from kiln.model.config import ModelConfig
from kiln.release.hf import ReleaseError, bytes_to_unicode, recover_merges, to_hf_state_dict

TYPES = ("F16", "Q8_0", "F32")  # what write_gguf writes; F32 for a lossless file
QUANT_BLOCK = 32  # Q8_0 quantises rows in blocks of 32 values; a row of another length stays F16, as llama.cpp does


def _split_names() -> dict[str, str]:
    """Kiln's split patterns (trained and imported) -> the llama.cpp pre-tokenizer that splits text the same way."""
    from kiln.pretrained.gguf import PRE_TOKENIZERS, LLAMA3_SPLIT, QWEN2_SPLIT
    from kiln.pretrained.tokenizer import DIGITS_PAT
    from kiln.tokens.tokenizer import DIGITS_PAT_STR, GPT2_PAT_STR, GPT4_PAT_STR

    assert {"gpt-2", "smollm", "llama-bpe", "qwen2"} <= set(PRE_TOKENIZERS)
    return {
        GPT2_PAT_STR: "gpt-2",  # tiktoken's GPT-2 pattern (possessive quantifiers: the same splits)
        GPT4_PAT_STR: "llama-bpe",  # cl100k's pattern, which Llama 3 uses
        DIGITS_PAT_STR: "qwen2",  # the same with one digit per piece, which Qwen 2 uses
        DIGITS_PAT.format(digits=r"\p{N}"): "smollm",  # SmolLM's digits-then-GPT-2 split, imported
        LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2",  # imported Llama 3 and Qwen 2 vocabularies
    }


def gguf_architecture(cfg: ModelConfig) -> str:
    """The GGUF architecture of ``cfg``; ReleaseError saying why for a family llama.cpp's layout cannot hold."""
    if cfg.family == "llama":
        return "qwen3" if cfg.qk_norm else "llama"
    raise ReleaseError(f"model.family={cfg.family!r}: Kiln writes GGUF for the llama family (Llama, Qwen3) only; "
                       "the GPT-2 and mixture-of-experts layouts are not mapped")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's ``permute``: each head's rows from two halves to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer_meta(enc, n_rows: int) -> dict[str, Any]:
    """tokenizer.ggml.* of Kiln's encoding: every id up to the embedding's rows (unused rows as [PAD{i}])."""
    from gguf import TokenType

    pre = _split_names().get(enc._pat_str)
    if pre is None:
        raise ReleaseError(f"tokenizer {enc.name}: its split pattern {enc._pat_str[:60]!r}... has no llama.cpp "
                           "pre-tokenizer that splits the same way; GGUF would tokenize differently, so none is written")
    b2u = bytes_to_unicode()
    tokens = [f"[PAD{i}]" for i in range(n_rows)]
    types = [int(TokenType.UNUSED)] * n_rows
    for token, i in enc._mergeable_ranks.items():
        tokens[i], types[i] = "".join(b2u[b] for b in token), int(TokenType.NORMAL)
    for token, i in enc._special_tokens.items():
        tokens[i], types[i] = token, int(TokenType.CONTROL)
    merges = [" ".join("".join(b2u[b] for b in part) for part in pair) for pair in recover_merges(enc._mergeable_ranks)]
    return {"pre": pre, "tokens": tokens, "types": types, "merges": merges}


def write_gguf(state: dict[str, torch.Tensor], cfg: ModelConfig, enc, path: str | os.PathLike, qtype: str = "F16",
               chat_template: str = "", name: str = "", license: str = "") -> dict[str, Any]:
    """Write Kiln's ``state`` (of ``cfg``) and encoding ``enc`` as a GGUF file of ``qtype`` at ``path`` (atomically);
    return {file, type, tensor_types, bytes, sha256}."""
    import gguf

    if qtype not in TYPES:
        raise ReleaseError(f"GGUF type {qtype!r}: Kiln writes {', '.join(TYPES)}")
    arch = gguf_architecture(cfg)
    if enc.n_vocab > cfg.vocab_size:
        raise ReleaseError(f"tokenizer {enc.name} has {enc.n_vocab} ids but the embedding {cfg.vocab_size} rows")
    tok = _tokenizer_meta(enc, cfg.vocab_size)
    tensors = to_hf_state_dict(state, cfg)  # Hugging Face names (and a muP model's multipliers folded in)
    table = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], cfg.n_layer)
    path = Path(path)
    kinds = Counter()
    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(str(tmp), arch)
        w.add_name(name or f"kiln {arch}")
        if license:
            w.add_license(license)
        w.add_block_count(cfg.n_layer)
        w.add_context_length(cfg.block_size)
        w.add_embedding_length(cfg.n_embd)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.n_head)
        w.add_head_count_kv(cfg.n_kv_head or cfg.n_head)
        w.add_rope_freq_base(float(cfg.rope_theta))
        w.add_layer_norm_rms_eps(float(cfg.norm_eps))
        head_dim = cfg.n_embd // cfg.n_head
        w.add_rope_dimension_count(head_dim)
        if arch == "qwen3":
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        w.add_vocab_size(cfg.vocab_size)
        w.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                         "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype])
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(tok["pre"])
        w.add_token_list(tok["tokens"])
        w.add_token_types(tok["types"])
        w.add_token_merges(tok["merges"])
        w.add_bos_token_id(enc.eot_token)
        w.add_eos_token_id(enc.eot_token)
        w.add_pad_token_id(enc.eot_token)
        w.add_add_bos_token(False)
        if chat_template:
            w.add_chat_template(chat_template)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for hf_name, t in tensors.items():
            g = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if g is None:
                raise ReleaseError(f"weight {hf_name} has no GGUF name for architecture {arch}")
            a = t.detach().float().cpu().numpy()
            if arch == "llama" and hf_name.endswith("self_attn.q_proj.weight"):
                a = _permute(a, cfg.n_head)
            elif arch == "llama" and hf_name.endswith("self_attn.k_proj.weight"):
                a = _permute(a, cfg.n_kv_head or cfg.n_head)
            if a.ndim == 1 or qtype == "F32":
                kind = "F32"
                w.add_tensor(g, np.ascontiguousarray(a, dtype=np.float32))
            elif qtype == "Q8_0" and a.shape[-1] % QUANT_BLOCK == 0:
                kind = "Q8_0"
                w.add_tensor(g, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                             raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                kind = "F16"
                w.add_tensor(g, a.astype(np.float16))
            kinds[kind] += 1
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return {"file": path.name, "type": qtype, "tensor_types": dict(sorted(kinds.items())), "bytes": path.stat().st_size,
            "sha256": sha256_file(path), "pre": tok["pre"], "chat_template": bool(chat_template)}
