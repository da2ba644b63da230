"""Activation checkpointing of one block, with a flag that tells code inside the block whether this call is the
recomputation in backward (a mixture of experts counts its expert load once per step, not again when rerun).

``checkpoint_block(block, *args)`` is torch.utils.checkpoint's non-reentrant checkpoint; its ``context_fn`` marks
the recomputation, entered in whichever thread autograd runs it in (so the flag is per thread).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from torch.utils.checkpoint import checkpoint

_state = threading.local()


@contextlib.contextmanager
def _rerunning() -> Iterator[None]:
    before = getattr(_state, "on", False)
    _state.on = True
    try:
        yield
    finally:
        _state.on = before


def recomputing() -> bool:
    """Whether the calling code runs inside a checkpointed block's recomputation in backward."""
    return getattr(_state, "on", False)


def checkpoint_block(block: Any, *args: Any) -> Any:
    """``block(*args)`` keeping only its inputs for backward, where it is rerun (with ``recomputing()`` true)."""
    return checkpoint(block, *args, use_reentrant=False,
                      context_fn=lambda: (contextlib.nullcontext(), _rerunning()))
