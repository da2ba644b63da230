"""Tiny GGUF files written with the ``gguf`` package's own writer, as llama.cpp's converter writes them (no hub).

``write_gguf(hf_folder, path, qtype="F32")`` turns a tiny Hugging Face llama or qwen3 folder (tests/hfmodels.py
``save_tiny``) into a GGUF: llama.cpp's metadata keys, tensor names from gguf's name map, the query and key rows
permuted for llama (llama.cpp's ``permute``), each 2-D weight stored as ``qtype`` (F32, F16, Q8_0, Q4_0, Q4_1, ...), norms
as F32; the vocabulary, merges, token types and a chat template from tokenizer.json. ``hf_gguf_logits(path, ids)``
runs transformers' GGUF loader on it.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PRE = {"gpt2": "gpt-2", "llama3": "llama-bpe", "qwen2": "qwen2", "smollm": "smollm"}


def _permute(w, n_head: int):
    """llama.cpp's converter's permute: each head's rows from two halves to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_folder: Path, path: Path, qtype: str = "F32", style: str = "llama3", license: str = "apache-2.0",
               pad_rows: bool = True, skip: tuple[str, ...] = (), meta_overrides: dict | None = None) -> Path:
    """A GGUF of the Hugging Face folder (see the module docstring). ``pad_rows``: embedding rows past the vocabulary
    get llama.cpp's ``[PAD{i}]`` tokens of type UNUSED; ``skip`` leaves those metadata keys out; ``meta_overrides``
    sets metadata keys (name -> value) after the rest, to make damaged files."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    hf_folder, path = Path(hf_folder), Path(path)
    cfg = json.loads((hf_folder / "config.json").read_text())
    tok = json.loads((hf_folder / "tokenizer.json").read_text())
    arch = {"llama": "llama", "qwen3": "qwen3"}[cfg["model_type"]]
    n_layer, n_head, n_kv = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    meta = {
        "general.name": f"tiny {arch}", "general.license": license,
        f"{arch}.block_count": n_layer, f"{arch}.context_length": cfg["max_position_embeddings"],
        f"{arch}.embedding_length": cfg["hidden_size"], f"{arch}.feed_forward_length": cfg["intermediate_size"],
        f"{arch}.attention.head_count": n_head, f"{arch}.attention.head_count_kv": n_kv,
        f"{arch}.rope.freq_base": float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4)),
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
    }
    if arch == "qwen3":
        meta[f"{arch}.attention.key_length"] = cfg["head_dim"]
        meta[f"{arch}.attention.value_length"] = cfg["head_dim"]
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    specials = {t["id"] for t in tok["added_tokens"]}
    n_rows = cfg["vocab_size"]
    tokens = [""] * max(max(vocab.values()) + 1, n_rows if pad_rows else 0)
    types = [gguf.TokenType.NORMAL] * len(tokens)
    for t, i in vocab.items():
        tokens[i] = t
        if i in specials:
            types[i] = gguf.TokenType.CONTROL
    for i, t in enumerate(tokens):
        if not t:
            tokens[i], types[i] = f"[PAD{i}]", gguf.TokenType.UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    meta.update({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": PRE[style], "tokenizer.ggml.tokens": tokens,
                 "tokenizer.ggml.token_type": [int(t) for t in types], "tokenizer.ggml.merges": merges,
                 "tokenizer.chat_template": CHAT_TEMPLATE})
    eot = vocab.get("<|endoftext|>")
    if eot is not None:
        meta["tokenizer.ggml.eos_token_id"] = eot
    meta.update(meta_overrides or {})
    for key, value in meta.items():
        if key in skip or key == "general.architecture":
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list) and value and isinstance(value[0], int):
            w.add_array(key, value)
        else:
            w.add_array(key, list(value))
    table = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], n_layer)
    qt = gguf.GGMLQuantizationType[qtype]
    for name, t in sorted(load_file(str(hf_folder / "model.safetensors")).items()):
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        t = t.astype(np.float32)
        if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            t = _permute(t, n_head)
        elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
            t = _permute(t, n_kv)
        gname = table.get_name(name, try_suffixes=(".weight", ".bias"))
        if t.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, t)
        elif qt == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gname, t.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(t, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_gguf_logits(path: Path, ids):
    """(B, T, V) float32 logits of transformers' model loaded from the GGUF file (its own dequantiser)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float()
