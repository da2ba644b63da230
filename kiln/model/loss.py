"""The fused head-and-loss kernel: mean next-token cross-entropy of ``h @ w.T`` a chunk of tokens at a time.

``linear_cross_entropy(x (B, T, C), w (V, C), targets (B, T))`` is what ``model(idx, targets)`` returns for every
family: LinearCrossEntropy, or its vocabulary-parallel form under tensor parallelism; the (N, V) logits never exist
at once. Tested against F.cross_entropy in tests/kiln/model/test_loss.py.
``token_logprobs(*head_inputs(model, x), y)`` is the per-token form post-training uses: log p(y_t) (B, T) through any
family's forward, chunk by chunk (tests/kiln/model/test_loss.py compares it with the full log-softmax).
"""

from __future__ import annotations

import torch

from kiln.model.parallel import is_dtensor

IGNORE_INDEX = -100  # targets with this value are left out of the loss (prompt tokens in SFT)
CE_CHUNK_BYTES = {"cpu": 32 << 20, "cuda": 256 << 20}  # fp32 logits per chunk (CPU: 32 MiB measured fastest on the bench model; 4 MiB was 20% slower)



def _add_head_grad(grad_w: torch.Tensor | None, g: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The head weight's gradient so far plus one chunk's g (n, V)^T @ h (n, C), kept in float32 (V, C): the first
    chunk makes it, later ones add in place (fused when the compute dtype is float32)."""
    if grad_w is None:
        return (g.t() @ h).float()
    if g.dtype == torch.float32:
        return grad_w.addmm_(g.t(), h)
    grad_w += (g.t() @ h).float()
    return grad_w


class LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``h @ w.T`` against targets without materialising all (N, V) logits.

    For each chunk of tokens the logits are computed, their log-sum-exp taken, and, since the gradient of
    cross-entropy is known in the forward pass (softmax minus one-hot), the chunk's contributions to the
    gradients of ``h`` and ``w`` are computed right away while the chunk is still in cache; backward only
    scales them. The same matmul FLOPs as logits + F.cross_entropy, but no (N, V) tensor, no separate
    log-softmax passes, and memory of one chunk (the idea of Liger Kernel's fused linear cross-entropy, which
    is GPU-only; written here in plain PyTorch so it runs on CPU and CUDA alike).
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # h (N, C) final hidden states, w (V, C) output embedding, targets (N,) int64
        n, v = targets.numel(), w.size(0)
        chunk = max(16, CE_CHUNK_BYTES["cuda" if h.is_cuda else "cpu"] // (4 * v))
        want_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if want_grad else None  # (N, C)
        grad_w = None  # (V, C) fp32, made by the first chunk
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        valid = targets != IGNORE_INDEX  # (N,)
        masked = not bool(valid.all())  # one host sync per call; most pretraining batches mask nothing
        dev = h.device.type
        cd = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype  # the matmuls' dtype
        wc = w.to(cd)  # (V, C)
        for s in range(0, n, chunk):
            hc, tc = h[s:s + chunk], targets[s:s + chunk].clamp(min=0)  # (n, C), (n,)
            e = (hc @ wc.t()).float()  # (n, V) logits
            e.sub_(e.amax(dim=-1, keepdim=True))  # shifted: exp cannot overflow
            picked = e.gather(1, tc[:, None]).squeeze(1)  # (n,) shifted logit of the target
            e.exp_()
            z = e.sum(dim=-1)  # (n,) partition function of the shifted logits
            nll = z.log() - picked  # (n,) = logsumexp - target logit
            total += (nll * valid[s:s + chunk]).sum() if masked else nll.sum()
            if want_grad:
                e.div_(z[:, None])  # (n, V) softmax, in place of the logits
                e[torch.arange(e.size(0), device=e.device), tc] -= 1.0  # softmax - one-hot = d nll / d logits
                if masked:
                    e.mul_(valid[s:s + chunk, None])
                g, hcc = e.to(cd), hc.to(cd)  # (n, V), (n, C)
                if grad_h.dtype == cd:
                    torch.mm(g, wc, out=grad_h[s:s + chunk])  # (n, C), straight into place
                else:
                    grad_h[s:s + chunk] = g @ wc
                grad_w = _add_head_grad(grad_w, g, hcc)
        return _keep_grads(ctx, grad_h, grad_w, valid, w.dtype, total)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return (*_scaled_grads(ctx, grad_out), None)


def _keep_grads(ctx, grad_h, grad_w, valid: torch.Tensor, w_dtype: torch.dtype, total: torch.Tensor) -> torch.Tensor:
    """Save the gradients a fused loss computed in its forward pass and return the mean loss over valid targets."""
    count = valid.sum().clamp(min=1)
    ctx.save_for_backward(grad_h, grad_w, count)
    ctx.w_dtype = w_dtype
    return total / count


def _scaled_grads(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The saved gradients of h and w scaled by the upstream gradient of the mean."""
    grad_h, grad_w, count = ctx.saved_tensors
    scale = grad_out / count
    return grad_h * scale.to(grad_h.dtype), (grad_w * scale).to(ctx.w_dtype)


class VocabParallelLinearCrossEntropy(torch.autograd.Function):
    """LinearCrossEntropy with the head split over the vocabulary across a tensor-parallel group (Megatron-LM's
    vocabulary-parallel cross-entropy, fused and chunked as LinearCrossEntropy is).

    Every rank holds all N tokens' hidden states ``h`` (N, C) and its rows ``w`` (V / tp, C) of the head, starting at
    vocabulary id ``start``. Per chunk: local logits (n, V / tp); the row maximum is all-reduced (max), then the
    target's shifted logit (on the rank that holds the target's row, 0 elsewhere) and the sum of exponentials are
    all-reduced (sum) together, which gives every rank the same loss; the local softmax minus one-hot gives this
    rank's head rows' gradient and its share of h's gradient, which are summed across the group once at the end.
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, start: int, group) -> torch.Tensor:
        import torch.distributed as dist

        n, v = targets.numel(), w.size(0)
        chunk = _chunk_rows(h, v)
        want_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(h) if want_grad else None  # (N, C): this rank's share
        grad_w = None  # (V / tp, C) fp32
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        valid = targets != IGNORE_INDEX  # (N,)
        cd = _compute_dtype(h)
        wc = w.to(cd)  # (V / tp, C)
        for s in range(0, n, chunk):
            hc, tc = h[s:s + chunk], targets[s:s + chunk]  # (n, C), (n,)
            mine = (tc >= start) & (tc < start + v)  # (n,) targets whose head row this rank holds
            local = torch.where(mine, tc - start, 0)  # (n,)
            e = (hc @ wc.t()).float()  # (n, V / tp) logits
            top = e.amax(dim=-1)  # (n,)
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            e.sub_(top[:, None])
            picked = e.gather(1, local[:, None]).squeeze(1) * mine  # (n,)
            e.exp_()
            both = torch.stack([picked, e.sum(dim=-1)])  # (2, n): target logit, partition function
            dist.all_reduce(both, group=group)
            picked, z = both[0], both[1]
            keep = valid[s:s + chunk]
            total += ((z.log() - picked) * keep).sum()
            if want_grad:
                e.div_(z[:, None])  # (n, V / tp) softmax
                rows = torch.arange(e.size(0), device=e.device)
                e[rows[mine], local[mine]] -= 1.0  # minus the one-hot, where this rank holds the target
                e.mul_(keep[:, None])
                g, hcc = e.to(cd), hc.to(cd)
                grad_h[s:s + chunk] = (g @ wc).to(grad_h.dtype)
                grad_w = _add_head_grad(grad_w, g, hcc)
        if want_grad:
            dist.all_reduce(grad_h, group=group)  # h's gradient: every rank's vocabulary rows contribute
        if grad_w is None and want_grad:  # no tokens
            grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        return _keep_grads(ctx, grad_h, grad_w, valid, w.dtype, total)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return (*_scaled_grads(ctx, grad_out), None, None, None)


def linear_cross_entropy(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of the head ``w`` (V, C) over final hidden states ``x`` (B, T, C) and
    ``targets`` (B, T): LinearCrossEntropy, or under tensor parallelism (``w`` a DTensor sharded on the vocabulary,
    ``x`` sequence-sharded) VocabParallelLinearCrossEntropy over the gathered sequence."""
    if not is_dtensor(w):
        return LinearCrossEntropy.apply(x.reshape(-1, x.size(-1)), w, targets.reshape(-1))
    from torch.distributed.tensor import Replicate, Shard

    mesh = w.device_mesh
    if mesh.ndim != 1 or tuple(w.placements) != (Shard(0),):
        raise ValueError(f"the output head is a DTensor placed {tuple(w.placements)} on {mesh}; the vocabulary-parallel "
                         "loss takes a head sharded on the vocabulary (Shard(0)) over one tensor-parallel mesh")
    if is_dtensor(x):
        x = x.redistribute(placements=[Replicate()]).to_local()  # (B, T, C): every rank needs every token
    rows = -(-w.size(0) // mesh.size())  # torch.chunk's shard size
    start = min(mesh.get_local_rank() * rows, w.size(0))
    return VocabParallelLinearCrossEntropy.apply(x.reshape(-1, x.size(-1)), w.to_local(), targets.reshape(-1), start,
                                                 mesh.get_group())


def _chunk_rows(h: torch.Tensor, v: int) -> int:
    """Tokens per chunk so one chunk's fp32 logits (n, V) take CE_CHUNK_BYTES."""
    return max(16, CE_CHUNK_BYTES["cuda" if h.is_cuda else "cpu"] // (4 * v))


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    dev = h.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype


class LinearTokenLogProbs(torch.autograd.Function):
    """Per-token log p(target) under softmax(h @ w.T), a chunk of tokens at a time: (N,) float32, 0 where the
    target is IGNORE_INDEX. What post-training (DPO, RL, PPO, the measures) needs instead of a mean.

    Each chunk's logits are made, log-softmaxed in float32 and the target's entry kept, so no (N, V) tensor exists;
    the numbers are those of ``log_softmax((h @ w.T).float()).gather(targets)`` row for row. Unlike
    LinearCrossEntropy the gradient cannot be taken in the forward pass (every token has its own upstream
    gradient), so backward recomputes each chunk's logits: one more head matmul per chunk, the same memory.
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # h (N, C) final hidden states, w (V, C) output embedding, targets (N,) int64
        n = targets.numel()
        chunk = _chunk_rows(h, w.size(0))
        cd = _compute_dtype(h)
        wc = w.to(cd)  # (V, C)
        tgt = targets.clamp(min=0)  # (N,)
        out = torch.empty(n, dtype=torch.float32, device=h.device)  # (N,)
        for s in range(0, n, chunk):
            logp = torch.log_softmax((h[s:s + chunk] @ wc.t()).float(), dim=-1)  # (n, V)
            out[s:s + chunk] = logp.gather(1, tgt[s:s + chunk, None]).squeeze(1)
        ctx.save_for_backward(h, w, targets)
        ctx.cd, ctx.chunk = cd, chunk
        return out * (targets != IGNORE_INDEX)  # (N,)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        h, w, targets = ctx.saved_tensors
        cd, chunk = ctx.cd, ctx.chunk
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_all = grad_out.float() * (targets != IGNORE_INDEX)  # (N,) upstream gradient, 0 off the targets
        tgt = targets.clamp(min=0)  # (N,)
        wc = w.to(cd)  # (V, C)
        grad_h = torch.empty_like(h) if want_h else None  # (N, C)
        grad_w = None  # (V, C) fp32, made by the first chunk
        for s in range(0, targets.numel(), chunk):
            hc = h[s:s + chunk].to(cd)  # (n, C)
            with torch.enable_grad():  # the log-softmax's own backward, so the gradient is the unchunked one's
                e = (hc @ wc.t()).float().detach().requires_grad_(True)  # (n, V) logits
                picked = torch.log_softmax(e, dim=-1).gather(1, tgt[s:s + chunk, None]).squeeze(1)  # (n,)
                (ge,) = torch.autograd.grad(picked, e, g_all[s:s + chunk])  # (n, V) d/d logits
            g = ge.to(cd)  # (n, V)
            if want_h:
                grad_h[s:s + chunk] = g @ wc
            if want_w:
                grad_w = _add_head_grad(grad_w, g, hc)
        return grad_h, grad_w.to(w.dtype) if grad_w is not None else None, None


def token_logprobs(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """h (..., C), w (V, C), targets (...) -> log p(targets) (...) float32, 0 at IGNORE_INDEX (LinearTokenLogProbs)."""
    return LinearTokenLogProbs.apply(h.reshape(-1, h.size(-1)), w, targets.reshape(-1)).view(targets.shape)


@torch.no_grad()
def greedy_hits(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """h (..., C), w (V, C), targets (...) -> bool (...): the target is the argmax of its logits, a chunk at a time
    (False at IGNORE_INDEX)."""
    hf, t = h.reshape(-1, h.size(-1)), targets.reshape(-1)
    wc = w.to(_compute_dtype(hf))
    chunk = _chunk_rows(hf, w.size(0))
    hit = torch.cat([(hf[s:s + chunk] @ wc.t()).float().argmax(-1) == t[s:s + chunk]
                     for s in range(0, t.numel(), chunk)]) if t.numel() else t.new_zeros(0, dtype=torch.bool)
    return (hit & (t != IGNORE_INDEX)).view(targets.shape)


def head_inputs(model: torch.nn.Module, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``model(idx)`` feeds its vocabulary head: final hidden states (B, T, C) and the head weight (V, C).

    The model's own forward runs (through a DDP or FSDP wrapper when given one, so their hooks run as in training);
    a pre-hook on its ``lm_head`` keeps the head's input and weight as the head sees them (FSDP's unsharded
    weight; a LoRA head's merged weight) and hands the head zero positions, so no (B, T, V) logits are made.
    The head is the family's (kiln.model.families.Parts.head); one other than a bias-free Linear (or a LoRA adapter
    on one) is an error.
    """
    from kiln.model.families import of

    raw = getattr(model, "module", model)  # DDP keeps the model in .module; FSDP2 shards it in place
    head = raw.get_submodule(of(raw.config).parts.head.removesuffix(".weight"))  # the family's head (lm_head)
    seen: dict[str, torch.Tensor] = {}

    def keep(module: torch.nn.Module, args: tuple) -> tuple:
        seen["h"], seen["w"] = args[0], _head_weight(module)
        return (args[0][..., :0, :],)  # (B, 0, C): the head's own matmul does no work

    handle = head.register_forward_pre_hook(keep)
    try:
        empty = model(idx)  # (B, 0, V)
    finally:
        handle.remove()
    h = seen["h"]
    if torch.is_grad_enabled():  # + 0.0 ties the forward's output into the graph, so hooks on it (FSDP's) still run
        h = h + empty.sum().to(h.dtype)
    return h, seen["w"]


def _head_weight(head: torch.nn.Module) -> torch.Tensor:
    if hasattr(head, "merged_weight"):  # kiln.model.lora.LoRALinear: W + scale * B @ A, differentiable in A and B
        if head.active and head.dropout and head.training:
            raise ValueError("a LoRA adapter with dropout on lm_head cannot be folded into one weight; set lora.dropout: 0")
        if head.active:
            return head.merged_weight()
        from kiln.model.quant import dequantize

        return dequantize(head.base.weight)
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ValueError(f"lm_head is {type(head).__name__}: per-token log-probs need a bias-free nn.Linear head")
    return head.weight
