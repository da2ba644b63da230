"""The llama family: RMSNorm, rotary positions, SwiGLU, grouped-query attention, no biases (with ``qk_norm``,
Qwen 3's dense layout), as Hugging Face's LlamaForCausalLM holds it. ``FAMILY`` is what the rest of Kiln reads
(kiln.model.families)."""

from __future__ import annotations

from kiln.model.config import ModelConfig
from kiln.model.families import Counts, Family, Fields, Parallelize, Parts, StateDictAdapter
from kiln.model.llama.counts import flops_per_token, layer_params, saved_per_token
from kiln.model.llama.model import Llama
from kiln.model.llama.parallelize import tp_plan
from kiln.model.llama.state_dict_adapter import hf_config, mup_fold, read_hf_config


def complete(cfg: ModelConfig) -> None:
    """Fill the derived fields (key/value heads, SwiGLU width) and check the grouped-query and rotary shapes."""
    if cfg.n_kv_head == 0:
        cfg.n_kv_head = cfg.n_head
    if cfg.n_head % cfg.n_kv_head:
        raise ValueError(f"model.n_head ({cfg.n_head}) must be a multiple of model.n_kv_head ({cfg.n_kv_head})")
    if cfg.intermediate_size == 0:
        cfg.intermediate_size = -(-(8 * cfg.n_embd // 3) // 64) * 64
    if (cfg.n_embd // cfg.n_head) % 2:
        raise ValueError(f"model.n_embd / model.n_head = {cfg.n_embd // cfg.n_head} must be even for rotary embeddings")


FAMILY = Family(
    name="llama", model=Llama,
    fields=Fields(("family", "vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "n_kv_head",
                   "intermediate_size", "rope_theta", "norm_eps", "qk_norm", "tie_embeddings",
                   "mup_base_width"),  # left out at 0 (kiln.model.config.OMITTED_AT_DEFAULT)
                  complete=complete),
    parts=Parts(embedding="model.embed_tokens.weight",
                lora_targets=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
                tied=lambda cfg: cfg.tie_embeddings, kv_heads=lambda cfg: cfg.n_kv_head),
    counts=Counts(layer_params=layer_params,
                  embedding_params=lambda cfg: cfg.vocab_size * cfg.n_embd * (1 if cfg.tie_embeddings else 2),
                  final_norm_params=lambda cfg: cfg.n_embd,  # RMSNorm: a weight only
                  saved_per_token=saved_per_token, flops_per_token=flops_per_token),
    parallelize=Parallelize(tp_plan=tp_plan, first_stage=("model.embed_tokens",), last_stage=("model.norm", "lm_head")),
    adapter=StateDictAdapter(
        style="Llama-style", hf_config=hf_config, mup_fold=mup_fold,
        # Mistral without a sliding window is Llama's computation under another name
        readers={"llama": read_hf_config, "mistral": read_hf_config,
                 "qwen3": lambda path, doc: read_hf_config(path, doc, qk_norm=True)}),
)
