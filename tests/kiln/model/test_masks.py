"""Tests for kiln.model.masks and the families' ``attn_mask``: a window of two documents, masked, equals each
document run alone; no mask is today's causal path; gradients stay inside documents.

Run: python -m pytest tests/kiln/model/test_masks.py -q
"""

from __future__ import annotations

import copy

import pytest
import torch

from kiln.model.cache import KVCache
from kiln.model.config import ModelConfig
from kiln.model.families import build_model
from kiln.model.masks import document_ids, document_mask

EOT = 0  # any id works: the mask takes it as an argument; these models never see a tokenizer
FAMILIES = {
    "gpt2": dict(family="gpt2", vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32),
    "llama": dict(family="llama", vocab_size=64, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                  bias=False),
}


def make(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(**FAMILIES[family])).eval()


def doc(n: int, seed: int) -> torch.Tensor:
    """[EOT] + n tokens, as kiln.tokens.shards writes a document: (n + 1,) int64."""
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.tensor([EOT]), torch.randint(1, 64, (n,), generator=g)])


def shifted_positions(model: torch.nn.Module, offset: int) -> torch.nn.Module:
    """A copy of the GPT whose position table starts at ``offset``: position p of a sequence reads row p + offset."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        table = m.transformer.wpe.weight  # (block_size, C)
        table[: table.size(0) - offset] = model.transformer.wpe.weight[offset:].clone()
    return m


def test_document_ids_count_eots_and_an_eot_opens_its_document() -> None:
    x = torch.tensor([[5, 6, 0, 7, 8, 0, 9], [0, 1, 2, 3, 0, 0, 4]])
    assert document_ids(x, eot=0).tolist() == [[0, 0, 1, 1, 1, 2, 2], [1, 1, 1, 1, 2, 3, 3]]
    m = document_mask(x, eot=0)
    assert m.shape == (2, 1, 7, 7) and m.dtype == torch.bool
    assert m[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0, 0],
        [0, 0, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 1, 1],
    ]
    assert m[1, 0, 5].int().tolist() == [0, 0, 0, 0, 0, 1, 0]  # an EOT right after an EOT is a document of its own
    assert torch.equal(document_mask(torch.tensor([[3, 4, 5]]), 0)[0, 0], torch.ones(3, 3, dtype=torch.bool).tril())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_masked_window_of_two_documents_equals_each_document_run_alone(family) -> None:
    model = make(family)
    a, b = doc(11, seed=1), doc(15, seed=2)  # 12 + 16 = 28 tokens
    x = torch.stack([torch.cat([a, b]), torch.cat([b, a])])  # (2, 28): the split point differs per row
    with torch.no_grad():
        masked = model(x, attn_mask=document_mask(x, EOT))  # (2, 28, V)
        alone_a, alone_b = model(a[None])[0], model(b[None])[0]  # (12, V), (16, V) each from position 0
        plain = model(x)  # attention across the document boundary
    assert torch.allclose(masked[0, :12], alone_a, atol=1e-5) and torch.allclose(masked[1, :16], alone_b, atol=1e-5)
    if family == "llama":
        # rotary scores depend only on position differences: the second document at its window offset equals the
        # same document run from position 0
        assert torch.allclose(masked[0, 12:], alone_b, atol=1e-5) and torch.allclose(masked[1, 16:], alone_a, atol=1e-5)
    else:
        # learned absolute positions: the second document equals itself run at its window offset, not from 0
        with torch.no_grad():
            at_12, at_16 = shifted_positions(model, 12)(b[None])[0], shifted_positions(model, 16)(a[None])[0]
        assert torch.allclose(masked[0, 12:], at_12, atol=1e-5) and torch.allclose(masked[1, 16:], at_16, atol=1e-5)
        assert not torch.allclose(masked[0, 12:], alone_b, atol=1e-3)
    assert (plain[0, 12:] - masked[0, 12:]).abs().max() > 1e-3  # without the mask the second document sees the first
    assert torch.equal(plain[0, :12], model(x[:1])[0, :12])  # the first document's rows are the same either way


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_without_eots_the_mask_is_the_causal_mask(family) -> None:
    model = make(family)
    x = torch.randint(1, 64, (3, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(model(x, attn_mask=document_mask(x, EOT)), model(x), atol=1e-6)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gradients_flow_within_documents_only(family) -> None:
    model = make(family).train()
    embed = model.transformer.wte if family == "gpt2" else model.model.embed_tokens
    seen = {}

    def keep(mod, inp, out) -> None:
        out.retain_grad()
        seen["out"] = out

    embed.register_forward_hook(keep)
    x = torch.cat([doc(9, seed=4), doc(12, seed=5)])[None]  # (1, 23): documents at 0..9 and 10..22
    y = torch.full_like(x, -100)
    y[0, 10:] = torch.randint(1, 64, (13,), generator=torch.Generator().manual_seed(6))  # loss on document 2 only
    loss = model(x, y, attn_mask=document_mask(x, EOT))
    loss.backward()
    g = seen["out"].grad[0]  # (23, C) gradient at each input position's embedding
    assert torch.isfinite(loss) and g[10:].abs().sum(dim=-1).min() > 0
    assert torch.equal(g[:10], torch.zeros_like(g[:10]))  # nothing reaches the first document
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(gr is not None and torch.isfinite(gr).all() for gr in grads)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_activation_checkpointing_recomputes_with_the_mask(family) -> None:
    x = torch.cat([doc(9, seed=7), doc(14, seed=8)])[None].repeat(2, 1)  # (2, 25)
    y = torch.roll(x, -1, dims=1)
    grads = []
    for recompute in (False, True):
        model = make(family).train()
        model.checkpoint_blocks = recompute
        loss = model(x, y, attn_mask=document_mask(x, EOT))
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (l0, g0), (l1, g1) = grads
    assert torch.equal(l0, l1) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g0, g1))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_mask_is_refused_with_a_kv_cache_or_the_wrong_shape(family) -> None:
    model = make(family)
    x = torch.tensor([[0, 5, 6, 0, 7]])
    with pytest.raises(ValueError, match="KV cache"):
        model(x, cache=KVCache.for_model(model, 1), attn_mask=document_mask(x, EOT))
    with pytest.raises(ValueError, match=r"\(1, 1, 5, 5\) bool tensor"):
        model(x, attn_mask=document_mask(x, EOT).float())
