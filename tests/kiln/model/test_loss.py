"""Tests for kiln.model.loss's per-token head: log p(target) a chunk at a time equals the log-softmax of the logits
(values and gradients, one chunk and many, fp32 and bf16 autocast), through any family's forward (head_inputs),
LoRA adapters included, and never keeps a (B, T, V) tensor for backward.

Run: python -m pytest tests/kiln/model/test_loss.py -q
"""

from __future__ import annotations

import pytest
import torch

import kiln.model.loss as km
from kiln.model.config import ModelConfig
from kiln.model.families import build_model
from kiln.model.lora import LoRAConfig, apply_lora
from kiln.model.loss import IGNORE_INDEX, greedy_hits, head_inputs, token_logprobs

FAMILIES = {
    "gpt2": dict(vocab_size=300, block_size=32, n_layer=2, n_head=2, n_embd=32),
    "llama": dict(family="llama", vocab_size=300, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32),
}
CHUNKS = pytest.mark.parametrize("chunk_bytes", [1 << 12, 1 << 30], ids=["many-chunks", "one-chunk"])


def make(family: str = "gpt2") -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(**FAMILIES[family]))


def reference(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The full log-softmax the post-training stages took before (kiln.posttrain.logprobs.token_logps)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    return logp.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (y != IGNORE_INDEX)


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, 300, (3, 30), generator=g), torch.randint(0, 300, (3, 30), generator=g)
    y[0, :7] = IGNORE_INDEX  # prompt tokens carry no log-prob
    y[2, 25:] = IGNORE_INDEX  # nor does padding
    return x, y


@CHUNKS
def test_token_logprobs_equal_the_log_softmax_and_its_gradients(monkeypatch, chunk_bytes) -> None:
    monkeypatch.setitem(km.CE_CHUNK_BYTES, "cpu", chunk_bytes)  # 4 KiB: chunks of 16 tokens, a ragged last one
    g = torch.Generator().manual_seed(0)
    h = torch.randn(90, 24, generator=g, requires_grad=True)
    w = (0.3 * torch.randn(300, 24, generator=g)).requires_grad_(True)
    t = torch.randint(0, 300, (90,), generator=g)
    t[:11] = IGNORE_INDEX
    up = torch.randn(90, generator=g)  # a different upstream gradient per token, as DPO's and PPO's losses give
    ref = reference(h @ w.t(), t)
    (gh, gw) = torch.autograd.grad((ref * up).sum(), (h, w))
    got = token_logprobs(h, w, t)
    (ch, cw) = torch.autograd.grad((got * up).sum(), (h, w))
    assert got.dtype == torch.float32 and got.shape == (90,)
    # the same log-softmax per row; a chunk's matmul may round its last bit apart from the whole one's (BLAS kernels
    # pick their blocking by shape: bit for bit on Intel AVX-512, not on AMD)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    assert torch.count_nonzero(got[:11]) == 0
    assert torch.allclose(ch, gh, rtol=1e-5, atol=1e-6) and torch.allclose(cw, gw, rtol=1e-5, atol=1e-6)  # sum order
    if chunk_bytes == 1 << 30:  # one chunk: the weight gradient is one matmul too, so equal bit for bit
        assert torch.equal(ch, gh) and torch.equal(cw, gw)
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(h, w, t), ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@CHUNKS
def test_head_inputs_give_the_models_logprobs_and_parameter_gradients(monkeypatch, family, chunk_bytes) -> None:
    monkeypatch.setitem(km.CE_CHUNK_BYTES, "cpu", chunk_bytes)
    a, b = make(family), make(family)
    x, y = batch()
    up = torch.linspace(-1, 2, 90).view(3, 30)
    ref = reference(a(x), y)
    (ref * up).sum().backward()
    h, w = head_inputs(b, x)
    assert h.shape == (3, 30, b.config.n_embd) and w is b.lm_head.weight
    got = token_logprobs(h, w, y)
    (got * up).sum().backward()
    assert torch.equal(got, ref)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa.grad, pb.grad, rtol=1e-5, atol=1e-6), name
        if chunk_bytes == 1 << 30:
            assert torch.equal(pa.grad, pb.grad), name
    assert not b.lm_head._forward_pre_hooks  # the hook is gone: the next forward gives logits again
    assert b(x).shape == (3, 30, 300)


def test_greedy_hits_are_the_argmax_matches(monkeypatch) -> None:
    monkeypatch.setitem(km.CE_CHUNK_BYTES, "cpu", 1 << 12)
    m = make("llama").eval()
    x, y = batch()
    with torch.no_grad():
        logits = m(x)
        y[1, :10] = logits[1, :10].argmax(-1)  # some hits for certain
        h, w = head_inputs(m, x)
        assert torch.equal(greedy_hits(h, w, y), (logits.argmax(-1) == y) & (y != IGNORE_INDEX))
    assert int(greedy_hits(h, w, y).sum()) >= 10


def test_lora_adapters_are_in_the_logprobs_and_get_the_gradients() -> None:
    a, b = make("llama"), make("llama")
    for m in (a, b):
        torch.manual_seed(5)
        apply_lora(m, LoRAConfig(enabled=True, rank=4))
        for name, p in m.named_parameters():
            if name.endswith("lora_B"):
                p.data.normal_(0, 0.05)  # nonzero updates, so the adapters change the log-probs
    x, y = batch()
    ref = reference(a(x), y)
    ref.sum().backward()
    got = token_logprobs(*head_inputs(b, x), y)
    got.sum().backward()
    assert torch.equal(got, ref)
    grads = [(n, pa.grad, pb.grad) for (n, pa), pb in zip(a.named_parameters(), b.parameters()) if pa.requires_grad]
    assert grads and all(gb is not None and torch.allclose(ga, gb, rtol=1e-5, atol=1e-6) for _, ga, gb in grads)


def test_bf16_autocast_matches_the_autocast_log_softmax() -> None:
    """The CUDA path (bf16 head matmul, fp32 log-softmax), run on CPU's autocast."""
    a, b = make(), make()
    x, y = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = reference(a(x), y)
        got = token_logprobs(*head_inputs(b, x), y)
    ref.sum().backward()
    got.sum().backward()
    assert got.dtype == torch.float32
    assert torch.allclose(got, ref, rtol=0, atol=1e-5)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        scale = pa.grad.abs().max().clamp(min=1e-6)
        assert ((pa.grad - pb.grad).abs().max() / scale).item() < 0.02, name


def mlp_width() -> int:
    return ModelConfig(**FAMILIES["llama"]).intermediate_size


def test_no_vocabulary_wide_tensor_is_kept_for_backward(monkeypatch) -> None:
    monkeypatch.setitem(km.CE_CHUNK_BYTES, "cpu", 1 << 12)  # 16-token chunks of (16, 300) logits
    x, y = batch()

    def widest_saved(fn) -> int:
        sizes: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            sizes.append(t.numel())
            return t

        m = make("llama")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(m).sum().backward()
        return max(sizes)

    assert widest_saved(lambda m: reference(m(x), y)) >= 3 * 30 * 300  # the old path keeps the (B, T, V) log-softmax
    # the chunked head keeps hidden states and weights: the widest saved tensor is the blocks' MLP input (B, T, 128)
    assert widest_saved(lambda m: token_logprobs(*head_inputs(m, x), y)) == 3 * 30 * mlp_width()


def test_a_head_that_is_not_a_linear_is_named() -> None:
    m = make()
    m.lm_head = torch.nn.Sequential(m.lm_head)
    with pytest.raises(ValueError, match="lm_head is Sequential"):
        head_inputs(m, torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize("chunk_bytes", [1 << 12, 1 << 30], ids=["many-chunks", "one-chunk"])
def test_chunked_loss_equals_cross_entropy_of_the_logits(monkeypatch, chunk_bytes) -> None:
    import torch.nn.functional as F

    import kiln.model.loss as km

    monkeypatch.setitem(km.CE_CHUNK_BYTES, "cpu", chunk_bytes)  # 4 KiB: chunks of 16 tokens, with a ragged last one
    a, b = make(), make()
    x = torch.randint(0, 300, (3, 30))
    y = torch.randint(0, 300, (3, 30))
    y[0, :7] = -100  # prompt tokens of an SFT example carry no loss
    ref = F.cross_entropy(a(x).flatten(0, 1), y.flatten(), ignore_index=-100)
    ref.backward()
    loss = b(x, y)
    loss.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-6), name
    with torch.no_grad():
        assert b(x, y).item() == pytest.approx(ref.item(), rel=1e-6)  # evaluation: no gradient work


@pytest.mark.parametrize("chunk_bytes", [1 << 12, 1 << 30], ids=["many-chunks", "one-chunk"])
def test_chunked_loss_under_bf16_autocast_matches_autocast_cross_entropy(monkeypatch, chunk_bytes) -> None:
    """The CUDA training path (bf16 autocast: bf16 matmuls, fp32 softmax and gradient sums), run on CPU's autocast."""
    import torch.nn.functional as F

    import kiln.model.loss as km

    monkeypatch.setitem(km.CE_CHUNK_BYTES, "cpu", chunk_bytes)
    a, b = make(), make()
    x = torch.randint(0, 300, (3, 30))
    y = torch.randint(0, 300, (3, 30))
    y[1, :5] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = a(x)
        assert logits.dtype == torch.float32  # the head's bf16 output is returned as fp32
        ref = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
        loss = b(x, y)
    ref.backward()
    loss.backward()
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(ref.item(), rel=2e-3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert pb.grad is not None and pb.grad.dtype == torch.float32, name
        scale = pa.grad.abs().max().clamp(min=1e-6)
        assert ((pa.grad - pb.grad).abs().max() / scale).item() < 0.05, name
