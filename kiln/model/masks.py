"""Document-aware attention masks for packed windows: each token attends to earlier tokens of its own document only.

``mask = document_mask(idx, eot)`` gives the (B, 1, T, T) boolean mask both families take as ``attn_mask`` in
training (``model(idx, targets, attn_mask=mask)``; pretraining builds it when the job sets ``document_mask``).
Kiln's shards write every document as ``[EOT] + tokens`` (kiln.tokens.shards), so an end-of-text token opens the document
after it: it belongs to that document, and the tokens before it belong to the one it closes. A window that starts
mid-document treats its first tokens, up to the first EOT, as one document. Check with ``python -m kiln.model.masks``.
"""

from __future__ import annotations

import torch


def document_ids(idx: torch.Tensor, eot: int) -> torch.Tensor:
    """idx (B, T) token ids -> (B, T) int64 document index per position: the number of EOT tokens at or before it."""
    return (idx == eot).long().cumsum(dim=1)  # (B, T)


def document_mask(idx: torch.Tensor, eot: int) -> torch.Tensor:
    """idx (B, T) -> (B, 1, T, T) bool, True where query t may attend key s: s <= t and no EOT in (s, t]."""
    T = idx.size(1)
    doc = document_ids(idx, eot)  # (B, T)
    same = doc[:, :, None] == doc[:, None, :]  # (B, T, T) query row, key column
    causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()  # (T, T)
    return (same & causal).unsqueeze(1)  # (B, 1, T, T), broadcast over heads


def check_attn_mask(mask: torch.Tensor | None, B: int, T: int, cache: object | None) -> None:
    """A model forward's ``attn_mask`` must be (B, 1, T, T) bool, and is for training only (no KV cache)."""
    if mask is None:
        return
    if cache is not None:
        raise ValueError("attn_mask is for training forwards only: generation with a KV cache masks by its own positions")
    if mask.dtype != torch.bool or tuple(mask.shape) != (B, 1, T, T):
        raise ValueError(f"attn_mask must be a ({B}, 1, {T}, {T}) bool tensor (kiln.model.masks.document_mask), "
                         f"got {tuple(mask.shape)} {mask.dtype}")


if __name__ == "__main__":
    x = torch.tensor([[5, 6, 0, 7, 8, 0, 9]])
    print(document_ids(x, eot=0).tolist())
    print(document_mask(x, eot=0)[0, 0].int())
