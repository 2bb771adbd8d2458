"""A mark on the work a step runs again (activation recomputation, a loss's recomputed logits),
so that a FLOP counter can tell model FLOPs, which MFU counts (as PaLM and Megatron define it),
from the FLOPs a step executes: one strategy's recomputation is not more useful work."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

_depth = 0


@contextmanager
def recomputing() -> Iterator[None]:
    """Mark what runs inside as recomputed work (nests)."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def active() -> bool:
    """Whether the ops running now are recomputed work."""
    return _depth > 0


def contexts() -> tuple[AbstractContextManager, AbstractContextManager]:
    """``torch.utils.checkpoint``'s context_fn: nothing in forward, the mark while backward
    recomputes."""
    return nullcontext(), recomputing()
