"""config.json of a Hugging Face causal LM -> Kiln's ModelConfig, for the architectures Kiln's model files reproduce.

``model_config(folder)``; a model_type Kiln has no exact equivalent for is refused with what is supported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from kiln.model.config import ModelConfig


class PretrainedError(ValueError):
    """A Hugging Face folder cannot be imported exactly; the message names the file and what to do."""


def read_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise PretrainedError(f"{path}: missing; a Hugging Face model folder needs config.json beside its safetensors "
                              "(save one with model.save_pretrained(folder))")
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PretrainedError(f"{path}: not readable JSON ({e}); re-download or re-save the model") from e
    if not isinstance(doc, dict):
        raise PretrainedError(f"{path}: expected a JSON object")
    return doc


def _require(path: Path, doc: dict, key: str, allowed: Callable[[Any], bool], what: str) -> None:
    if key in doc and doc[key] is not None and not allowed(doc[key]):
        raise PretrainedError(f"{path}: {key}={doc[key]!r} is not supported ({what}); Kiln's model would compute "
                              "different outputs, so it is not imported")


def _gpt2(path: Path, doc: dict) -> ModelConfig:
    n_embd = doc["n_embd"]
    _require(path, doc, "n_inner", lambda v: v == 4 * n_embd, "Kiln's GPT-2 MLP is 4 x n_embd wide")
    _require(path, doc, "activation_function", lambda v: v in ("gelu_new", "gelu_pytorch_tanh"), "tanh GELU only")
    _require(path, doc, "layer_norm_epsilon", lambda v: abs(v - 1e-5) < 1e-12, "LayerNorm epsilon 1e-5")
    _require(path, doc, "tie_word_embeddings", lambda v: v is True, "the head is tied to the embedding")
    _require(path, doc, "scale_attn_weights", lambda v: v is True, "attention scaled by 1/sqrt(head size)")
    _require(path, doc, "scale_attn_by_inverse_layer_idx", lambda v: v is False, "no per-layer attention scaling")
    _require(path, doc, "add_cross_attention", lambda v: v is False, "decoder only")
    return ModelConfig(vocab_size=doc["vocab_size"], block_size=doc.get("n_positions") or doc["n_ctx"],
                       n_layer=doc["n_layer"], n_head=doc["n_head"], n_embd=n_embd, dropout=0.0, bias=True)


def _rope_theta(path: Path, doc: dict) -> float:
    """rope_theta from transformers 5's ``rope_parameters`` or the older top-level key; scaled RoPE is refused."""
    rope = doc.get("rope_parameters") or doc.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind != "default":
        raise PretrainedError(f"{path}: rope type {kind!r} is not supported (Kiln's Llama has plain RoPE); "
                              "import a model without rope scaling")
    return float(rope.get("rope_theta") or doc.get("rope_theta") or 10000.0)


def _llama(path: Path, doc: dict, qk_norm: bool = False) -> ModelConfig:
    n_embd, n_head = doc["hidden_size"], doc["num_attention_heads"]
    _require(path, doc, "hidden_act", lambda v: v == "silu", "SwiGLU with SiLU")
    _require(path, doc, "attention_bias", lambda v: v is False, "no attention biases")
    _require(path, doc, "mlp_bias", lambda v: v is False, "no MLP biases")
    _require(path, doc, "head_dim", lambda v: v == n_embd // n_head, "head_dim = hidden_size / num_attention_heads")
    _require(path, doc, "use_sliding_window", lambda v: v is False, "full attention")
    _require(path, doc, "sliding_window", lambda v: False, "full attention")
    _require(path, doc, "pretraining_tp", lambda v: v == 1, "no tensor-parallel slicing")
    return ModelConfig(
        family="llama", vocab_size=doc["vocab_size"], block_size=doc["max_position_embeddings"],
        n_layer=doc["num_hidden_layers"], n_head=n_head, n_embd=n_embd,
        n_kv_head=doc.get("num_key_value_heads") or n_head, intermediate_size=doc["intermediate_size"],
        rope_theta=_rope_theta(path, doc), norm_eps=float(doc.get("rms_norm_eps", 1e-6)), qk_norm=qk_norm,
        tie_embeddings=bool(doc.get("tie_word_embeddings", False)), bias=False,
    )


# model_type -> config.json reader; Mistral without a sliding window is Llama's computation under another name.
READERS: dict[str, Callable[[Path, dict], ModelConfig]] = {
    "gpt2": _gpt2,
    "llama": _llama,
    "mistral": _llama,
    "qwen3": lambda path, doc: _llama(path, doc, qk_norm=True),
}


def model_config(folder: Path) -> tuple[ModelConfig, dict[str, Any]]:
    """(Kiln's ModelConfig, the raw config.json) of a Hugging Face folder; unsupported architectures are refused."""
    path = Path(folder) / "config.json"
    doc = read_config(folder)
    kind = doc.get("model_type")
    if kind not in READERS:
        raise PretrainedError(f"{path}: model_type {kind!r} is not supported; Kiln imports {', '.join(READERS)} "
                              "(GPT-2 and Llama-style decoders it computes exactly)")
    try:
        return READERS[kind](path, doc), doc
    except KeyError as e:
        raise PretrainedError(f"{path}: key {e.args[0]!r} missing for model_type {kind!r}; the file is incomplete") from e
    except ValueError as e:
        if isinstance(e, PretrainedError):
            raise
        raise PretrainedError(f"{path}: {e}") from e
