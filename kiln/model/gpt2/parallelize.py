"""GPT-2's tensor- and sequence-parallel plan (kiln.model.tensor_parallel.apply_tp)."""

from __future__ import annotations

from kiln.model.config import ModelConfig


def tp_plan(cfg: ModelConfig) -> dict:
    """Tensor and sequence parallelism (kiln.model.tensor_parallel): the token table row-parallel and the position
    table replicated, their sum cut into sequence shards at the first block; norms on sequence shards, the fused
    c_attn column-parallel by heads within each of q, k, v and c_fc by hidden units, both c_proj row-parallel back to
    sequence shards; the (tied) head column-parallel over the vocabulary."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    from kiln.model.tensor_parallel import FusedColwiseParallel, Replicated

    seq, whole = Shard(1), Replicate()
    layer = "transformer.h.*."
    return {
        "transformer.wte": RowwiseParallel(input_layouts=whole, output_layouts=whole, use_local_output=False),
        "transformer.wpe": Replicated(),
        # Block calls are block(x, cache, doc_mask); the first one cuts the embeddings' sum into sequence shards
        "transformer.h.0": PrepareModuleInput(input_layouts=(whole, None, None), desired_input_layouts=(seq, None, None),
                                              use_local_output=True),
        layer + "ln_1": SequenceParallel(),
        layer + "attn": PrepareModuleInput(input_layouts=(seq, None, None), desired_input_layouts=(whole, None, None)),
        layer + "attn.c_attn": FusedColwiseParallel(3),
        layer + "attn.c_proj": RowwiseParallel(output_layouts=seq),
        layer + "ln_2": SequenceParallel(),
        layer + "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,)),
        layer + "mlp.c_fc": ColwiseParallel(),
        layer + "mlp.c_proj": RowwiseParallel(output_layouts=seq),
        "transformer.ln_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=whole),  # logits; the loss reads the weight
    }
