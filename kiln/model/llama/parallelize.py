"""Llama's tensor- and sequence-parallel plan (kiln.model.tensor_parallel.apply_tp)."""

from __future__ import annotations

from kiln.model.config import ModelConfig


def tp_plan(cfg: ModelConfig) -> dict:
    """Tensor and sequence parallelism (kiln.model.tensor_parallel): the embedding row-parallel into sequence
    shards, norms on sequence shards, q/k/v and gate/up column-parallel (whole heads and hidden units per rank),
    o/down row-parallel back to sequence shards, the head column-parallel over the vocabulary."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    from kiln.model.tensor_parallel import LocalReplicated

    seq, whole = Shard(1), Replicate()
    layer = "model.layers.*."
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=whole, output_layouts=seq),
        layer + "input_layernorm": SequenceParallel(),
        # Block calls self_attn(x, cos, sin, cache, doc_mask): only x is gathered
        layer + "self_attn": PrepareModuleInput(input_layouts=(seq, None, None, None, None),
                                                desired_input_layouts=(whole, None, None, None, None)),
        **{layer + f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
        layer + "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
        layer + "post_attention_layernorm": SequenceParallel(),
        layer + "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,)),
        layer + "mlp.gate_proj": ColwiseParallel(),
        layer + "mlp.up_proj": ColwiseParallel(),
        layer + "mlp.down_proj": RowwiseParallel(output_layouts=seq),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=whole),  # logits; the loss reads the weight
        # QK-norm: one weight per head dimension, shared by the heads every rank holds a share of
        **({layer + f"self_attn.{n}_norm": LocalReplicated() for n in "qk"} if cfg.qk_norm else {}),
    }
