"""One model config for every family Kiln trains (``family: gpt2 | llama``), with the named sizes of each.

``ModelConfig(family="llama", n_layer=2, ...)``; ``preset_fields("tiny", "llama")`` gives a named size's fields;
``model_dict(cfg)`` is the serialised form that plans, checkpoints and bundles record.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Annotated

from kiln.common.config import Domain


@dataclass
class ModelConfig:
    family: str = "gpt2"  # architecture: gpt2 (LayerNorm, learned positions, GELU MLP), llama (RMSNorm, RoPE, SwiGLU,
    # GQA) or moe (llama's attention with QK-norm and a mixture of SwiGLU experts per block, Qwen3-MoE's layout)
    vocab_size: Annotated[int, Domain(1)] = 8192  # tokens the embedding covers (padded up to a multiple of 64 for speed)
    block_size: Annotated[int, Domain(1)] = 256  # longest context: the position table (gpt2) or the rotary cache (llama)
    n_layer: Annotated[int, Domain(1)] = 4  # transformer blocks
    n_head: Annotated[int, Domain(1)] = 4  # attention (query) heads per block
    n_embd: Annotated[int, Domain(1)] = 256  # residual stream width; must divide by n_head
    dropout: Annotated[float, Domain(0, 1, high_open=True)] = 0.0  # dropout on attention and MLP outputs (0 for pretraining)
    bias: bool = True  # gpt2: biases in Linear and LayerNorm, as GPT-2 has (llama has none)
    n_kv_head: Annotated[int, Domain(0)] = 0  # llama: key/value heads (grouped-query attention); 0 means n_head (multi-head attention)
    intermediate_size: Annotated[int, Domain(0)] = 0  # llama: SwiGLU hidden width; 0 means 8/3 n_embd rounded up to a multiple of 64
    rope_theta: Annotated[float, Domain(0, low_open=True)] = 10000.0  # llama: rotary embedding base
    norm_eps: Annotated[float, Domain(0, low_open=True)] = 1e-5  # llama: RMSNorm epsilon
    qk_norm: bool = False  # llama: RMSNorm on each query and key head before the rotation (as Qwen 3, OLMo 2)
    tie_embeddings: bool = True  # llama: the output head shares the token embedding (gpt2 always ties)
    n_experts: Annotated[int, Domain(1)] = 8  # moe: routed experts in each block's mixture of experts
    n_experts_per_token: Annotated[int, Domain(1)] = 2  # moe: experts each token is sent to (top-k token choice)
    moe_intermediate_size: Annotated[int, Domain(0)] = 0  # moe: each expert's SwiGLU width; 0 means intermediate_size / n_experts_per_token
    # (the active MLP parameters of the dense llama of the same shape)
    n_shared_experts: Annotated[int, Domain(0)] = 0  # moe: experts every token also passes through (one SwiGLU this many experts wide)
    norm_topk_prob: bool = True  # moe: renormalise the chosen experts' router probabilities to sum to 1 (Qwen3-MoE)
    router_balance: str = "aux_loss"  # moe: load balancing: aux_loss (switch/GShard loss), aux_free (DeepSeek-V3's
    # per-expert routing bias moved toward balance after each step, no loss) or none
    router_aux_loss_coef: Annotated[float, Domain(0)] = 0.001  # moe: weight of the balance loss E * sum_i f_i P_i (aux_loss)
    router_bias_rate: Annotated[float, Domain(0)] = 0.001  # moe: how far aux_free moves each expert's bias per step (DeepSeek-V3's gamma)
    router_z_loss_coef: Annotated[float, Domain(0)] = 0.0  # moe: weight of the router z-loss mean(logsumexp(logits)^2) (ST-MoE); 0 is off
    capacity_factor: Annotated[float, Domain(0)] = 0.0  # moe: an expert takes at most this x its even share of a batch's token slots, the
    # rest are dropped (counted as moe/dropped); 0 means dropless: every token reaches its experts
    mup_base_width: Annotated[int, Domain(0)] = 0  # gpt2, llama: muP relative to a base model of this n_embd (0: standard parametrisation)
    # (kiln.model.mup): width multiplier m = n_embd / mup_base_width, heads and depth fixed across widths; AdamW's lr
    # and the init tuned at the base width carry over to any n_embd

    def __post_init__(self) -> None:
        from kiln.model.families import family, names

        desc = family(self.family)  # an unknown family is an error listing the known ones
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})")
        for f in fields(self):
            if f.name not in desc.fields.names and f.name not in ("family", "bias"):
                if getattr(self, f.name) not in (f.default, desc.fields.fixed.get(f.name, f.default)):
                    users = [n for n in names() if f.name in family(n).fields.names]
                    raise ValueError(f"model.{f.name} applies to the {' and '.join(users)} "
                                     f"{'family' if len(users) == 1 else 'families'} only; set "
                                     f"model.family: {users[0]} or remove model.{f.name}")
        desc.fields.complete(self)
        base = self.mup_base_width  # muP's base model (kiln.model.mup): its n_embd, a whole number of heads
        if base < 0:
            raise ValueError(f"model.mup_base_width ({base}) must be 0 (standard parametrisation) or the base model's "
                             "n_embd (muP)")
        if base and base % self.n_head:
            raise ValueError(f"model.mup_base_width ({base}) must be divisible by model.n_head ({self.n_head}): muP "
                             f"keeps the {self.n_head} heads at every width, so the base model's heads are "
                             f"mup_base_width / n_head wide; choose a multiple of {self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


# Fields added after plans and checkpoints existed, left out of model_dict at their default: a config that does not
# use them serialises (and hashes) as it did before they existed.
OMITTED_AT_DEFAULT = ("mup_base_width",)


def model_dict(cfg: ModelConfig) -> dict:
    """The fields ``cfg.family`` uses, as plans, checkpoints and bundles record them (``ModelConfig(**d)`` reads it
    back). A GPT-2 config omits ``family`` (gpt2 is the default), so the plans, checkpoints and run versions written
    before families existed read back unchanged; likewise OMITTED_AT_DEFAULT's fields at their default."""
    from kiln.model.families import family

    d = asdict(cfg)
    defaults = ModelConfig.__dataclass_fields__
    return {k: d[k] for k in family(cfg.family).fields.names
            if not (k in OMITTED_AT_DEFAULT and d[k] == defaults[k].default)}


# Named sizes per family: the CPU configs Kiln's presets use and the published shapes. The GPT-2 sizes take GPT-2's
# vocabulary (50257, padded to 50304) from the tokenizer; block_size is their context length. The llama sizes
# follow SmolLM (135M: 30 layers of 576, 9 heads, 3 key/value heads) and Llama 3.2 1B.
MODEL_PRESETS: dict[str, dict[str, dict]] = {
    "gpt2": {
        "tiny": dict(n_layer=2, n_head=2, n_embd=64, block_size=64),  # CI and the smoke preset, <1M parameters
        "demo": dict(n_layer=4, n_head=4, n_embd=256, block_size=256),  # the CPU demo (the ModelConfig defaults)
        "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),  # GPT-2 small, 124M
        "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),  # 350M
        "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024),  # 774M
        "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024),  # 1.56B
    },
    "llama": {
        "tiny": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=64),  # CI, <1M parameters
        "demo": dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=256, block_size=256),  # the CPU demo variant
        "125m": dict(n_layer=12, n_head=12, n_kv_head=4, n_embd=768, intermediate_size=2048, block_size=2048),
        "smollm-135m": dict(n_layer=30, n_head=9, n_kv_head=3, n_embd=576, intermediate_size=1536, block_size=2048,
                            rope_theta=10000.0),
        "llama3.2-1b": dict(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, intermediate_size=8192,
                            block_size=8192, rope_theta=500000.0),
    },
    "moe": {  # llama's shapes with experts: each expert the dense width / k, the dense model's active parameters
        "tiny": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=64, n_experts=4, n_experts_per_token=2),
        "demo": dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=256, block_size=256, n_experts=8, n_experts_per_token=2),
        # Qwen3-30B-A3B's depth, width, heads and experts (its heads are 128 wide; here n_embd / n_head = 64)
        "qwen3-30b-a3b": dict(n_layer=48, n_head=32, n_kv_head=4, n_embd=2048, intermediate_size=6144,
                              n_experts=128, n_experts_per_token=8, moe_intermediate_size=768, block_size=4096,
                              rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=False),
    },
}


def preset_fields(name: str, family: str = "gpt2") -> dict:
    """ModelConfig fields of a named size of ``family``; an unknown name is an error that lists the known ones."""
    if family not in MODEL_PRESETS:
        from kiln.model.families import family as known

        known(family)  # an unknown family is an error listing the known ones
        raise ValueError(f"model_preset {name!r}: the {family} family has no named sizes; give the model's fields")
    sizes = MODEL_PRESETS[family]
    if name not in sizes:
        raise ValueError(f"unknown model preset {name!r} for family {family}; choose one of {', '.join(sizes)}")
    return dict(sizes[name], **({"family": family} if family != "gpt2" else {}))


def padded_vocab(n_vocab: int, multiple: int = 64) -> int:
    """Round the tokenizer's vocabulary up so the embedding matmul gets friendly shapes."""
    return ((n_vocab + multiple - 1) // multiple) * multiple
