"""The gpt2 family: GPT-2's architecture (LayerNorm, learned positions, GELU MLP, a tied head), as Hugging Face's
GPT2LMHeadModel holds it. ``FAMILY`` is what the rest of Kiln reads (kiln.model.families)."""

from __future__ import annotations

from kiln.model.families import Counts, Family, Fields, Parallelize, Parts, StateDictAdapter
from kiln.model.gpt2.counts import flops_per_token, layer_params, saved_per_token
from kiln.model.gpt2.model import GPT
from kiln.model.gpt2.parallelize import tp_plan
from kiln.model.gpt2.state_dict_adapter import hf_config, mup_fold, read_hf_config

FAMILY = Family(
    name="gpt2", model=GPT,
    # no `family`: the default; mup_base_width is left out at 0 (kiln.model.config.OMITTED_AT_DEFAULT)
    fields=Fields(("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "bias", "mup_base_width")),
    parts=Parts(embedding="transformer.wte.weight",
                lora_targets=("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
                tied=lambda cfg: True, kv_heads=lambda cfg: cfg.n_head),
    counts=Counts(layer_params=layer_params,
                  embedding_params=lambda cfg: (cfg.vocab_size + cfg.block_size) * cfg.n_embd,  # token and position
                  final_norm_params=lambda cfg: (2 if cfg.bias else 1) * cfg.n_embd,
                  saved_per_token=saved_per_token, flops_per_token=flops_per_token),
    # c_attn's rows are held rank-interleaved under TP (q_r | k_r | v_r per rank): checkpoints save them in order
    parallelize=Parallelize(tp_plan=tp_plan, tp_interleaved=True, first_stage=("transformer.wte", "transformer.wpe"),
                            last_stage=("transformer.ln_f", "lm_head")),
    adapter=StateDictAdapter(
        style="GPT-2-style", hf_config=hf_config, readers={"gpt2": read_hf_config}, mup_fold=mup_fold,
        transposed=("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"),
        prefix="transformer."),
)
