"""A sparse mixture-of-experts decoder: Llama's attention with QK-norm, and in every block a top-k token-choice
router over SwiGLU experts (plus optional shared experts) in place of the dense MLP.

Parameter names follow Hugging Face's ``Qwen3MoeForCausalLM`` as transformers 5 holds it in memory: the router is
``model.layers.N.mlp.gate.weight`` (E, C) and the experts two 3-D weights, ``mlp.experts.gate_up_proj`` (E, 2I, C)
and ``mlp.experts.down_proj`` (E, C, I). Release writes the per-expert names Qwen3-MoE checkpoints are published
with (``mlp.experts.{e}.gate_proj.weight`` ...), which every transformers version and inference engine reads.

Routing (Qwen3-MoE's): softmax over the E router logits, the top-k chosen, their probabilities renormalised to sum
to 1 (``norm_topk_prob``). Balance, by config:
- ``aux_loss``: the switch/GShard loss E * sum_i f_i P_i (f_i the fraction of token slots routed to expert i, P_i its
  mean router probability; Fedus et al. 2021 eq. 4), 1 at perfect balance, weighted by ``router_aux_loss_coef``;
- ``aux_free``: DeepSeek-V3's loss-free balancing (Wang et al. 2024): a per-expert bias added to the probabilities
  for choosing only (the gate weights stay the probabilities), moved by ``router_bias_rate`` toward balance after
  every optimizer step from the step's global load;
- ``router_z_loss_coef``: ST-MoE's z-loss mean(logsumexp(logits)^2), which keeps router logits small.
The balance and z losses reach the router as gradients (``_AddAux``) without changing the loss value a forward
returns, so training, validation and post-training read plain cross-entropy. With data parallelism the expert
load f is counted over every rank's tokens (one all-reduce of E numbers), so the loss equals one process's.

Capacity: ``capacity_factor`` 0 is dropless. Otherwise an expert takes at most ceil(cf * N * k / E) of a batch's
N * k token slots, in token order; the rest are dropped (their tokens keep the residual and the other experts'
outputs) and counted, never silently.

Expert parallelism (``apply_ep``): the experts' weights are DTensors sharded on the expert dim over the data-shard
ranks; tokens go to the rank holding their expert by ``all_to_all_single`` and come back the same way (autograd
through both). Experts run as a loop of matmuls, one per local expert (torch's grouped GEMM is CUDA-only).

Run a shape check with ``python -m kiln.model.moe``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from kiln.model.config import ModelConfig
from kiln.model.families import Family
from kiln.model.llama import MLP, Block, Llama
from kiln.model.llama import complete as complete_llama
from kiln.model.llama import flops_per_token as dense_flops
from kiln.model.llama import tp_plan as llama_tp_plan
from kiln.model.parallel import local_param

BALANCES = ("aux_loss", "aux_free", "none")


class _AddAux(torch.autograd.Function):
    """Return ``y`` unchanged; in backward, also send gradient ``scale`` into the scalar ``aux`` (an auxiliary loss
    that trains the router without being added to the reported loss)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=torch.float32, device=grad.device), None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient times ``scale`` (expert-parallel experts sum the gradients of every rank's loss;
    data parallelism averages: the factor makes them agree)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad * ctx.scale, None


def swiglu_experts(x: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """x (sum(counts), C) grouped by expert, ``counts[e]`` rows for expert e -> (sum(counts), C): each group through
    its expert, down(silu(gate(x)) * up(x)), with gate_up (E, 2I, C) and down (E, C, I)."""
    outs = []
    for e, xe in enumerate(x.split(counts)):
        g, u = F.linear(xe, gate_up[e]).chunk(2, dim=-1)  # (n_e, I) each
        outs.append(F.linear(F.silu(g) * u, down[e]))  # (n_e, C)
    return torch.cat(outs) if outs else x


class Experts(nn.Module):
    """E SwiGLU experts as two 3-D weights; under expert parallelism each rank holds E / ep of them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, c, i = cfg.n_experts, cfg.n_embd, cfg.moe_intermediate_size
        self.n_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, c).normal_(0.0, 0.02))  # re-drawn by the model's init
        self.down_proj = nn.Parameter(torch.empty(e, c, i).normal_(0.0, 0.02))
        self.ep_group: Any = None  # the expert-parallel process group (apply_ep); None: every expert is here
        self.grad_scale = 1.0  # 1 / data-parallel ranks under expert parallelism (see _ScaleGrad)

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        gu, down = local_param(self.gate_up_proj), local_param(self.down_proj)  # whole on every tensor-parallel rank
        if hasattr(gu, "to_local"):  # sharded over the expert-parallel ranks (and held whole by tensor-parallel ones,
            from torch.distributed.tensor import Partial, Shard  # each running its own tokens: partial gradients)

            grads = [Shard(0)] + [Partial()] * (gu.device_mesh.ndim - 1)
            gu, down = gu.to_local(grad_placements=grads), down.to_local(grad_placements=grads)
            if self.grad_scale != 1.0:
                gu, down = _ScaleGrad.apply(gu, self.grad_scale), _ScaleGrad.apply(down, self.grad_scale)
        return gu, down

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (n, C): token slots sorted by expert, ``counts`` (E,) of them per expert -> the experts' outputs (n, C)."""
        gu, down = self.local_weights()
        if self.ep_group is None:
            return swiglu_experts(x, counts.tolist(), gu, down)
        return self._expert_parallel(x, counts, gu, down)

    def _expert_parallel(self, x: torch.Tensor, counts: torch.Tensor, gu: torch.Tensor, down: torch.Tensor
                         ) -> torch.Tensor:
        """Send each slot to the rank holding its expert, run the local experts, send the outputs back."""
        from torch.distributed.nn.functional import all_to_all_single

        group, ranks = self.ep_group, dist.get_world_size(self.ep_group)
        local = self.n_experts // ranks
        send = counts.view(ranks, local)  # (ranks, local): this rank's slots for each rank's experts
        recv = torch.empty_like(send)  # recv[s, j]: rank s's slots for this rank's expert j
        dist.all_to_all_single(recv, send, group=group)
        send_rows, recv_rows = send.sum(1).tolist(), recv.sum(1).tolist()
        got = all_to_all_single(x.new_empty(sum(recv_rows), x.shape[1]), x.contiguous(), recv_rows, send_rows,
                                group=group)  # (sum recv, C): by source rank, then by local expert
        expert = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(ranks), recv.flatten())
        order = expert.argsort(stable=True)  # group the received slots by local expert
        y = swiglu_experts(got[order], recv.sum(0).tolist(), gu, down)
        y = y[order.argsort()]  # back to the order they arrived in
        return all_to_all_single(x.new_empty(x.shape), y.contiguous(), send_rows, recv_rows, group=group)


class SparseMLP(nn.Module):
    """The router, the routed experts and the shared experts of one block (HF: Qwen3MoeSparseMoeBlock)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.layer = layer  # the block it belongs to (a pipeline stage holds some of them)
        self.n_experts, self.top_k, self.norm_topk_prob = cfg.n_experts, cfg.n_experts_per_token, cfg.norm_topk_prob
        self.balance, self.capacity_factor = cfg.router_balance, cfg.capacity_factor
        self.aux_coef, self.z_coef, self.bias_rate = cfg.router_aux_loss_coef, cfg.router_z_loss_coef, cfg.router_bias_rate
        self.gate = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)  # the router
        self.experts = Experts(cfg)
        self.shared_experts = (MLP(cfg, cfg.n_shared_experts * cfg.moe_intermediate_size)
                               if cfg.n_shared_experts else None)
        # aux_free's per-expert routing bias: part of the model's state (checkpointed) only when it is used
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts), persistent=cfg.router_balance == "aux_free")
        # token slots routed to each expert (before capacity) and slots dropped, since the last end_step
        self.register_buffer("load", torch.zeros(cfg.n_experts), persistent=False)
        self.register_buffer("dropped", torch.zeros(()), persistent=False)
        self.dp_group: Any = None  # ranks whose tokens share one balance count (set by apply_moe); None: this rank
        self.pp_group: Any = None  # pipeline ranks holding the other blocks (their load is gathered for reports)
        self.counting = True  # off while a pipeline infers shapes on stand-in tensors
        self.aux_scale = 1.0  # the auxiliary losses' gradient scale (1 / gradient-accumulation micro-batches)
        self.last_losses: dict[str, float] = {}

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h (N, C) -> (router logits (N, E), chosen experts (N, k), their gate weights (N, k) in h's dtype)."""
        logits = F.linear(h, local_param(self.gate.weight))  # (N, E)
        probs = logits.float().softmax(dim=-1)  # (N, E)
        choose = probs + self.expert_bias if self.balance == "aux_free" else probs
        idx = choose.topk(self.top_k, dim=-1).indices  # (N, k)
        w = probs.gather(-1, idx)  # (N, k)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return logits, idx, w.to(h.dtype)

    def keep_mask(self, idx: torch.Tensor) -> torch.Tensor | None:
        """(N, k) bool: the slots within their expert's capacity (None when dropless)."""
        if self.capacity_factor <= 0:
            return None
        n_slots = idx.numel()
        cap = math.ceil(self.capacity_factor * n_slots / self.n_experts)
        onehot = F.one_hot(idx.reshape(-1), self.n_experts)  # (N*k, E)
        position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # each slot's place in its expert's queue, token order
        return (position < cap).view_as(idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = x.reshape(-1, C)  # (N, C)
        logits, idx, w = self.route(h)
        flat = idx.reshape(-1)  # (N*k,)
        counts_all = torch.bincount(flat, minlength=self.n_experts)  # (E,) slots chosen, before capacity
        keep = self.keep_mask(idx)
        if keep is not None:
            flat = torch.where(keep.reshape(-1), flat, self.n_experts)  # dropped slots sort past the last expert
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts + 1)[: self.n_experts]  # (E,) slots kept
        order = order[: int(counts.sum())]
        token = order // self.top_k  # (n,)
        y = self.experts(h[token], counts) * w.reshape(-1)[order, None]  # (n, C)
        out = torch.zeros_like(h).index_add_(0, token, y)  # (N, C)
        if self.shared_experts is not None:
            s = self.shared_experts
            g, u, d = (local_param(m.weight) for m in (s.gate_proj, s.up_proj, s.down_proj))
            out = out + F.dropout(F.linear(F.silu(F.linear(h, g)) * F.linear(h, u), d), s.dropout, self.training)
        if self.training and torch.is_grad_enabled():  # a training forward (validation runs without gradients)
            # not activation checkpointing's recomputation in backward, nor a pipeline's shape inference
            if self.counting and torch._C._current_graph_task_id() == -1:
                with torch.no_grad():
                    self.load += counts_all
                    self.dropped += flat.numel() - counts.sum()
            out = self._with_aux(out, logits, counts_all)
        return out.view(B, T, C)

    def _with_aux(self, out: torch.Tensor, logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        aux = logits.new_zeros((), dtype=torch.float32)
        losses = {}
        if self.balance == "aux_loss" and self.aux_coef > 0:
            with torch.no_grad():
                f = counts.float()
                if self.dp_group is not None:  # count every data-parallel rank's tokens, as one process would
                    dist.all_reduce(f, group=self.dp_group)
                f = f / f.sum()
            p = logits.float().softmax(dim=-1).mean(0)  # (E,)
            balance = self.n_experts * (f * p).sum()
            losses["moe/balance_loss"] = float(balance.detach())
            aux = aux + self.aux_coef * balance
        if self.z_coef > 0:
            z = torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
            losses["moe/z_loss"] = float(z.detach())
            aux = aux + self.z_coef * z
        self.last_losses = losses
        if not aux.requires_grad:
            return out
        return _AddAux.apply(out, aux, self.aux_scale)


class MoETransformer(Llama):
    """Llama with QK-norm whose blocks each hold a SparseMLP (HF: Qwen3MoeForCausalLM)."""

    def make_block(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return Block(cfg, layer, mlp=SparseMLP(cfg, layer))

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, Experts):
            nn.init.normal_(module.gate_up_proj, mean=0.0, std=0.02)
            nn.init.normal_(module.down_proj, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def active_params(self, non_embedding: bool = True) -> int:
        """Parameters one token passes through: the total less the routed experts it is not sent to."""
        cfg = self.config
        unused = (cfg.n_experts - cfg.n_experts_per_token) * 3 * cfg.n_embd * cfg.moe_intermediate_size
        return self.num_params(non_embedding) - cfg.n_layer * unused


# -- the training loop's view of the experts


def sparse_layers(model: nn.Module) -> list[SparseMLP]:
    return [m for m in model.modules() if isinstance(m, SparseMLP)]


def apply_moe(model: nn.Module, dp_group: Any, grad_accum: int, pp_group: Any = None, tp: int = 1) -> None:
    """Count the balance over ``dp_group``'s tokens (every rank holding other tokens: the data-parallel ranks and,
    under sequence parallelism, the tensor-parallel ones) and scale the auxiliary gradients for ``grad_accum``
    micro-batches (the loss of each is divided by it before backward; a pipeline schedule scales the summed
    gradients instead: 1) and for ``tp`` sequence shards, whose router gradients are summed. ``pp_group``: the
    pipeline ranks, whose blocks' loads end_step gathers."""
    for layer in sparse_layers(model):
        layer.dp_group, layer.pp_group = dp_group, pp_group
        layer.aux_scale = 1.0 / (grad_accum * tp)


def apply_ep(model: nn.Module, mesh, dp_ranks: int) -> set[nn.Parameter]:
    """Shard every block's experts on the expert dim over ``mesh``'s first dim (the expert-parallel ranks; a second
    dim, the tensor-parallel ranks, holds them whole: after apply_tp); return the sharded parameters (which FSDP2
    must leave alone). ``dp_ranks``: the ranks the loss is averaged over."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = set()
    for layer in sparse_layers(model):
        ex = layer.experts
        for name in ("gate_up_proj", "down_proj"):
            t = getattr(ex, name).data
            t = t.to_local() if hasattr(t, "to_local") else t  # replicated over the tensor-parallel ranks
            p = nn.Parameter(distribute_tensor(t, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1)))
            setattr(ex, name, p)
            out.add(p)
        ex.ep_group, ex.grad_scale = mesh.get_group(0), 1.0 / dp_ranks
    return out


@torch.no_grad()
def begin_step(layers: list[SparseMLP]) -> None:
    """Before a step's micro-batches: forget what the model's mixtures (``sparse_layers``) counted outside training
    steps (a pipeline schedule's shape-inference and evaluation forwards run in training mode)."""
    for m in layers:
        m.load.zero_()
        m.dropped.zero_()


@torch.no_grad()
def end_step(layers: list[SparseMLP]) -> dict[str, Any] | None:
    """After an optimizer step, for the model's mixtures (``sparse_layers``): the step's global expert load per layer
    (all-reduced over the data-parallel ranks), aux_free's bias moved toward balance, the counts reset. Returns
    {"load": (L, E) tensor, "dropped": slots, "losses": the last micro-batch's auxiliary losses}, or None for a dense
    model."""
    if not layers:
        return None
    load = torch.stack([m.load for m in layers])  # (L, E)
    dropped = torch.stack([m.dropped for m in layers]).sum()
    group = layers[0].dp_group
    if group is not None:
        both = torch.cat([load.flatten(), dropped.view(1)])
        dist.all_reduce(both, group=group)
        load, dropped = both[:-1].view_as(load), both[-1]
    losses: dict[str, float] = {}
    for i, m in enumerate(layers):
        if m.balance == "aux_free":
            m.expert_bias += m.bias_rate * torch.sign(load[i].mean() - load[i])  # under-loaded experts rise
        m.load.zero_()
        m.dropped.zero_()
        for k, v in m.last_losses.items():
            losses[k] = losses.get(k, 0.0) + v / len(layers)
    load, dropped = load.cpu(), float(dropped)
    if layers[0].pp_group is not None:  # pipeline stages: every block's load, in block order, on every rank
        parts: list[Any] = [None] * dist.get_world_size(layers[0].pp_group)
        dist.all_gather_object(parts, ([m.layer for m in layers], load.tolist(), dropped, losses),
                               group=layers[0].pp_group)
        rows = sorted((i, row) for idx, rows_, _, _ in parts for i, row in zip(idx, rows_))
        load = torch.tensor([row for _, row in rows], dtype=torch.float32)
        dropped = sum(p[2] for p in parts)
        keys = {k for p in parts for k in p[3]}
        losses = {k: sum(p[3].get(k, 0.0) for p in parts) / len(parts) for k in keys}
    return {"load": load, "dropped": dropped, "losses": losses}


def load_measures(load: torch.Tensor) -> dict[str, float]:
    """Balance of a (L, E) load: max/mean per layer averaged over layers (1 is perfect), the worst layer's, and the
    routing entropy as a fraction of log E (1 is perfect)."""
    mean = load.mean(-1).clamp_min(1e-9)
    ratio = load.max(-1).values / mean  # (L,)
    p = load / load.sum(-1, keepdim=True).clamp_min(1e-9)
    entropy = -(p * p.clamp_min(1e-12).log()).sum(-1) / math.log(load.shape[-1])  # (L,)
    return {"moe/load_max_over_mean": float(ratio.mean()), "moe/load_max_over_mean_worst": float(ratio.max()),
            "moe/load_entropy": float(entropy.mean())}


# -- the family descriptor


def tp_plan(cfg: ModelConfig) -> dict:
    """Llama's plan for the attention, the tables and the head (QK-norm included); each block's mixture of experts
    is held whole by every tensor-parallel rank and routes that rank's sequence shard (sequence parallelism through
    the experts: no collective inside the mixture, the weights' gradients summed across ranks after backward)."""
    from kiln.model.tensor_parallel import LocalReplicated

    layer = "model.layers.*."
    plan = {k: v for k, v in llama_tp_plan(cfg).items() if not k.startswith(layer + "mlp")}
    return {**plan, layer + "mlp": LocalReplicated()}


def complete(cfg: ModelConfig) -> None:
    """Llama's derived fields, QK-norm on (Qwen3-MoE has it), the expert width, and the routing settings checked."""
    cfg.qk_norm = FAMILY.fixed["qk_norm"]
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


def expert_params(cfg: ModelConfig) -> int:
    """One block's routed experts: E x (gate, up, down)."""
    return cfg.n_experts * 3 * cfg.n_embd * cfg.moe_intermediate_size


def layer_params(cfg: ModelConfig) -> int:
    """Attention (as llama's with QK-norm), two RMSNorms, the router, the routed and the shared experts."""
    c, kv = cfg.n_embd, cfg.n_kv_head * cfg.head_dim
    attn = 2 * c * c + 2 * c * kv + 2 * c + 2 * cfg.head_dim
    shared = 3 * c * cfg.n_shared_experts * cfg.moe_intermediate_size
    return attn + c * cfg.n_experts + expert_params(cfg) + shared


def active_layer_params(cfg: ModelConfig) -> int:
    """Parameters of one block a token passes through: the k routed experts it is sent to, not all E."""
    return layer_params(cfg) - (cfg.n_experts - cfg.n_experts_per_token) * 3 * cfg.n_embd * cfg.moe_intermediate_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token from the active parameters: llama's count (kiln.model.llama.flops_per_token) with the
    MLP as the k chosen experts and the shared ones, plus the router."""
    width = (cfg.n_experts_per_token + cfg.n_shared_experts) * cfg.moe_intermediate_size
    mlp_and_router = 3 * cfg.n_embd * width + cfg.n_embd * cfg.n_experts
    return dense_flops(cfg, seq_len, mlp=mlp_and_router)


def saved_per_token(cfg: ModelConfig) -> tuple[int, int]:
    """Llama's (with QK-norm) for the attention half; for the MoE half, per token slot (k of them) the gathered input,
    SwiGLU's gate, silu(gate), up and product, the output and its weighted copy, plus the router's logits and
    probabilities (E each) and the shared experts' SwiGLU."""
    c, kv = cfg.n_embd, cfg.n_kv_head * cfg.head_dim
    attn = 9 * c + 2 * kv + 3 * (c + kv)
    i = cfg.moe_intermediate_size
    moe = cfg.n_experts_per_token * (3 * c + 4 * i) + 2 * cfg.n_experts + 4 * cfg.n_shared_experts * i
    return attn + moe, 2 * c


def hf_config(cfg: ModelConfig, eot: int) -> dict:
    """config.json of Qwen3MoeForCausalLM: every block sparse, no shared experts, softmax top-k routing."""
    if cfg.n_shared_experts:
        raise ValueError(f"model.n_shared_experts={cfg.n_shared_experts}: Qwen3-MoE's layout has no shared experts; "
                         "a model trained with them cannot be released in it")
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layer,
        "num_experts": cfg.n_experts, "num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.n_experts_per_token,
        "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": False,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "bos_token_id": eot, "eos_token_id": eot, "tie_word_embeddings": cfg.tie_embeddings, "use_cache": True,
        "torch_dtype": "float32", "dtype": "float32",
    }


def read_hf_config(path, doc: dict) -> ModelConfig:
    """A qwen3_moe config.json as ModelConfig; a layout Kiln's model computes differently is refused by name."""
    from kiln.pretrained.config import PretrainedError, require, rope_theta

    n_embd, n_head = doc["hidden_size"], doc["num_attention_heads"]
    require(path, doc, "hidden_act", lambda v: v == "silu", "SwiGLU experts with SiLU")
    require(path, doc, "attention_bias", lambda v: v is False, "no attention biases")
    require(path, doc, "head_dim", lambda v: v == n_embd // n_head, "head_dim = hidden_size / num_attention_heads")
    require(path, doc, "use_sliding_window", lambda v: v is False, "full attention")
    require(path, doc, "decoder_sparse_step", lambda v: v == 1, "every block sparse (decoder_sparse_step 1)")
    require(path, doc, "mlp_only_layers", lambda v: v == [], "no dense blocks among the sparse ones")
    n_experts = doc.get("num_experts") or doc.get("num_local_experts") or 0  # transformers 5 writes the latter
    if n_experts < 1:
        raise PretrainedError(f"{path}: num_experts={n_experts!r}: a qwen3_moe model needs routed experts; a dense "
                              "model is imported as qwen3")
    return ModelConfig(
        family="moe", vocab_size=doc["vocab_size"], block_size=doc["max_position_embeddings"],
        n_layer=doc["num_hidden_layers"], n_head=n_head, n_embd=n_embd,
        n_kv_head=doc.get("num_key_value_heads") or n_head, intermediate_size=doc["intermediate_size"],
        rope_theta=rope_theta(path, doc), norm_eps=float(doc.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(doc.get("tie_word_embeddings", False)), bias=False,
        n_experts=n_experts, n_experts_per_token=doc["num_experts_per_tok"],
        moe_intermediate_size=doc["moe_intermediate_size"], norm_topk_prob=bool(doc.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(doc.get("router_aux_loss_coef", 0.001)),
    )


def to_hf_experts(state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """Kiln's 3-D expert weights -> Qwen3-MoE's per-expert names; an aux_free routing bias that is not zero cannot be
    expressed there (transformers would choose other experts) and is refused."""
    out: dict[str, Any] = {}
    i = cfg.moe_intermediate_size
    for name, t in state.items():
        if name.endswith(".mlp.expert_bias"):
            if bool((t != 0).any()):
                raise ValueError(f"{name}: router_balance aux_free left a routing bias that Qwen3-MoE's layout has "
                                 "no place for (transformers would route tokens to other experts); release a model "
                                 "trained with router_balance aux_loss or none")
            continue
        if name.endswith(".mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :i].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, i:].contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out


def from_hf_experts(tensors: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """Per-expert Qwen3-MoE names (or transformers 5's fused ones, kept) -> Kiln's 3-D weights; an expert count that
    does not match config.json's num_experts is refused naming the layer."""
    import re

    from kiln.pretrained.config import PretrainedError

    pattern = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    out: dict[str, Any] = {}
    per: dict[str, dict[int, dict[str, Any]]] = {}
    for name, t in tensors.items():
        m = pattern.match(name)
        if m:
            per.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        else:
            out[name] = t
    for base, experts in per.items():
        if sorted(experts) != list(range(cfg.n_experts)) or any(len(v) != 3 for v in experts.values()):
            raise PretrainedError(f"{base}*: the weights hold experts {sorted(experts)[:4]}... ({len(experts)} "
                                  f"experts) but config.json says num_experts={cfg.n_experts}; the router and the "
                                  "experts must match")
        out[base + "gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]])
                                                  for e in range(cfg.n_experts)])
        out[base + "down_proj"] = torch.stack([experts[e]["down_proj"] for e in range(cfg.n_experts)])
    for name, t in list(out.items()):
        if name.endswith(".mlp.gate.weight") and cfg.router_balance == "aux_free":
            out.setdefault(name.removesuffix("gate.weight") + "expert_bias", torch.zeros(cfg.n_experts))
        if name.endswith(".mlp.gate.weight") and t.shape[0] != cfg.n_experts:
            raise PretrainedError(f"{name}: a router over {t.shape[0]} experts but config.json says num_experts="
                                  f"{cfg.n_experts}; the router and the experts must match")
    return out


def tensor_count(cfg: ModelConfig) -> dict[str, int]:
    """Total and active (per token) parameters, the tables included once: what the planner and the card report."""
    emb = cfg.vocab_size * cfg.n_embd * (1 if cfg.tie_embeddings else 2)
    tail = cfg.n_embd
    return {"total": cfg.n_layer * layer_params(cfg) + emb + tail,
            "active": cfg.n_layer * active_layer_params(cfg) + emb + tail}


FAMILY = Family(
    name="moe", model=MoETransformer, style="Qwen3-MoE-style",
    fields=("family", "vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "n_kv_head",
            "intermediate_size", "rope_theta", "norm_eps", "tie_embeddings", "n_experts", "n_experts_per_token",
            "moe_intermediate_size", "n_shared_experts", "norm_topk_prob", "router_balance", "router_aux_loss_coef",
            "router_bias_rate", "router_z_loss_coef", "capacity_factor"),
    embedding="model.embed_tokens.weight",
    # the attention projections and the shared experts: the routed experts are 3-D weights, not nn.Linear layers
    lora_targets=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    tied=lambda cfg: cfg.tie_embeddings, kv_heads=lambda cfg: cfg.n_kv_head, complete=complete,
    layer_params=layer_params, active_layer_params=active_layer_params,
    routed=lambda cfg: (expert_params(cfg), cfg.n_experts, cfg.n_experts_per_token),
    embedding_params=lambda cfg: cfg.vocab_size * cfg.n_embd * (1 if cfg.tie_embeddings else 2),
    final_norm_params=lambda cfg: cfg.n_embd,
    saved_per_token=saved_per_token, flops_per_token=flops_per_token, hf_config=hf_config, tp_plan=tp_plan,
    first_stage=("model.embed_tokens",), last_stage=("model.norm", "lm_head"),
    hf_readers={"qwen3_moe": read_hf_config},
    hf_out=to_hf_experts, hf_in=from_hf_experts, fixed={"qk_norm": True},
    buffers=(".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq", ".mlp.load", ".mlp.dropped"),
)


if __name__ == "__main__":
    m = MoETransformer(ModelConfig(family="moe", n_layer=2, n_embd=64, n_head=4, n_kv_head=2))
    out = m(torch.zeros(2, 16, dtype=torch.long))
    print(tuple(out.shape), f"{m.num_params() / 1e6:.2f}M parameters, {m.active_params() / 1e6:.2f}M active")
