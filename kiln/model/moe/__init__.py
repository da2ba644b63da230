"""The moe family: llama's attention with QK-norm and a sparse mixture of SwiGLU experts in every block, as Hugging
Face's Qwen3MoeForCausalLM holds it (kiln.model.moe.model says how it routes and balances). ``FAMILY`` is what the
rest of Kiln reads (kiln.model.families)."""

from __future__ import annotations

from kiln.model.config import ModelConfig
from kiln.model.families import Counts, Family, Fields, Parallelize, Parts, StateDictAdapter
from kiln.model.llama import complete as complete_llama
from kiln.model.moe.counts import active_layer_params, expert_params, flops_per_token, layer_params, saved_per_token
from kiln.model.moe.model import BALANCES, MoETransformer
from kiln.model.moe.parallelize import tp_plan
from kiln.model.moe.state_dict_adapter import from_hf_experts, hf_config, read_hf_config, to_hf_experts

FIXED = {"qk_norm": True}  # Qwen3-MoE has QK-norm


def complete(cfg: ModelConfig) -> None:
    """Llama's derived fields, QK-norm on, the expert width, and the routing settings checked."""
    cfg.qk_norm = FIXED["qk_norm"]
    complete_llama(cfg)
    if cfg.n_experts < 1:
        raise ValueError(f"model.n_experts ({cfg.n_experts}) must be at least 1")
    if not 1 <= cfg.n_experts_per_token <= cfg.n_experts:
        raise ValueError(f"model.n_experts_per_token ({cfg.n_experts_per_token}) must be between 1 and "
                         f"model.n_experts ({cfg.n_experts})")
    if cfg.router_balance not in BALANCES:
        raise ValueError(f"model.router_balance: {cfg.router_balance!r} is not one of {', '.join(BALANCES)}")
    if cfg.capacity_factor < 0 or cfg.n_shared_experts < 0:
        raise ValueError("model.capacity_factor and model.n_shared_experts must not be negative")
    if cfg.moe_intermediate_size == 0:
        cfg.moe_intermediate_size = max(8, cfg.intermediate_size // cfg.n_experts_per_token)


FAMILY = Family(
    name="moe", model=MoETransformer,
    fields=Fields(("family", "vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "n_kv_head",
                   "intermediate_size", "rope_theta", "norm_eps", "tie_embeddings", "n_experts",
                   "n_experts_per_token", "moe_intermediate_size", "n_shared_experts", "norm_topk_prob",
                   "router_balance", "router_aux_loss_coef", "router_bias_rate", "router_z_loss_coef",
                   "capacity_factor"),
                  complete=complete, fixed=FIXED),
    # the attention projections: the routed experts are 3-D weights, not nn.Linear layers
    parts=Parts(embedding="model.embed_tokens.weight",
                lora_targets=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
                tied=lambda cfg: cfg.tie_embeddings, kv_heads=lambda cfg: cfg.n_kv_head),
    counts=Counts(layer_params=layer_params, active_layer_params=active_layer_params,
                  routed=lambda cfg: (expert_params(cfg), cfg.n_experts, cfg.n_experts_per_token),
                  embedding_params=lambda cfg: cfg.vocab_size * cfg.n_embd * (1 if cfg.tie_embeddings else 2),
                  final_norm_params=lambda cfg: cfg.n_embd,
                  saved_per_token=saved_per_token, flops_per_token=flops_per_token),
    parallelize=Parallelize(tp_plan=tp_plan, first_stage=("model.embed_tokens",), last_stage=("model.norm", "lm_head")),
    adapter=StateDictAdapter(
        style="Qwen3-MoE-style", hf_config=hf_config, readers={"qwen3_moe": read_hf_config},
        rename_out=to_hf_experts, rename_in=from_hf_experts,
        buffers=(".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq", ".mlp.load", ".mlp.dropped")),
)
