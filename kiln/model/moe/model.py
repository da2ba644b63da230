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

Run a shape check with ``python -m kiln.model.moe.model``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from kiln.model.config import ModelConfig
from kiln.model.llama.model import MLP, Block, Llama
from kiln.model.parallel import local_param
from kiln.model.recompute import recomputing


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
            if self.counting and not recomputing():
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


def sparse_layers(model: nn.Module) -> list[SparseMLP]:
    return [m for m in model.modules() if isinstance(m, SparseMLP)]


if __name__ == "__main__":
    m = MoETransformer(ModelConfig(family="moe", n_layer=2, n_embd=64, n_head=4, n_kv_head=2))
    out = m(torch.zeros(2, 16, dtype=torch.long))
    print(tuple(out.shape), f"{m.num_params() / 1e6:.2f}M parameters, {m.active_params() / 1e6:.2f}M active")
