"""Tests for kiln.model.recompute: a checkpointed block returns what the block returns, gets the same gradients, and
is told (``recomputing()``) only during its rerun in backward."""

from __future__ import annotations

import torch
import torch.nn as nn

from kiln.model.recompute import checkpoint_block, recomputing


class Spy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(recomputing())
        return torch.tanh(self.lin(x))


def test_the_rerun_in_backward_alone_is_marked_and_gradients_match() -> None:
    torch.manual_seed(0)
    block, x = Spy(), torch.randn(3, 4, requires_grad=True)
    plain = block(x)
    plain.sum().backward()
    want = (x.grad.clone(), block.lin.weight.grad.clone())
    x.grad, block.lin.weight.grad, block.seen = None, None, []

    out = checkpoint_block(block, x)
    torch.testing.assert_close(out, plain)
    assert block.seen == [False] and not recomputing()
    out.sum().backward()
    assert block.seen == [False, True] and not recomputing()  # rerun once, marked; the mark gone after
    torch.testing.assert_close(x.grad, want[0])
    torch.testing.assert_close(block.lin.weight.grad, want[1])
