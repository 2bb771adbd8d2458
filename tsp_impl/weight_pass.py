"""TSP's backward split in two, for the zero-bubble pipeline schedules (Qi et al., 2024).

A zero-bubble schedule runs each micro-batch's backward as an input pass (I: the gradient the
previous stage waits for) and, later, a weight pass (W: the weight gradients) that fills the
pipeline's bubbles. torch.distributed.pipelining splits a stage's backward by walking its
autograd graph, which finds no weight pass in TSP: each attention and MLP layer is one
autograd.Function whose backward moves the weight shards inside it. So TSP splits its own loops
where the algorithm splits them:

    I: the shards are broadcast (or circulate) again; each rank computes its tokens' dX and keeps,
       per shard, the gradients of the shard's outputs (attention: dQKV and A; MLP: dh, g)
    W: per shard, this rank's tokens' part of dW from what I kept, reduced to the shard's owner
       (the ring MLP: the accumulators go round as in the whole backward); no weight moves

The Functions return no gradient for their shard in I: they hand :class:`WeightPass` the work
of W, which accumulates each result into the shard's ``.grad`` when the schedule runs W (torch's
``dw_builder``: the runner it builds is called at that micro-batch's W action). Every rank of a
stage runs the same actions in the same order, so W's collectives line up. The embedding, the
LM head, the norms and the experts' blocks keep their whole backward in I.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

T = TypeVar("T")
WeightGrad = Callable[[], torch.Tensor]  # a layer's weight pass: this rank's dW of its shard
Defer = Callable[[WeightGrad], None]  # where a backward hands its weight pass, not running it


def drained(parts: list[T]) -> Iterator[T]:
    """``parts`` in order, each released as it is handed out (the weight pass frees what the
    input pass kept, shard by shard)."""
    parts.reverse()
    while parts:
        yield parts.pop()


def deferring(wpass: WeightPass | None, param: torch.Tensor) -> Defer | None:
    """Where a layer's backward hands its weight pass for ``param`` (None: it runs it)."""
    return None if wpass is None else functools.partial(wpass.defer, param)


class WeightPass:
    """The weight passes the input passes deferred since the last :meth:`take`, in order."""

    def __init__(self) -> None:
        self._queued: list[tuple[torch.nn.Parameter, WeightGrad]] = []
        self.ran = 0  # weight passes run so far (the tests' check that the split took place)
        self.pending = 0  # runners built and not yet run: micro-batches between their I and W
        self.most_pending = 0

    def check_done(self) -> None:
        """At a schedule's end nothing may wait: a weight pass never run would leave its shard
        without its gradient, silently."""
        if self._queued or self.pending:
            raise RuntimeError(
                f"weight passes left at the schedule's end: {len(self._queued)} queued outside "
                f"an input pass, {self.pending} micro-batches' never run"
            )

    def defer(self, param: torch.Tensor, grad: WeightGrad) -> None:
        """Queue ``grad``, whose result (this rank's gradient of ``param``) W accumulates."""
        assert isinstance(param, torch.nn.Parameter), "a weight pass accumulates into a leaf"
        self._queued.append((param, grad))

    def take(self) -> Callable[[], None]:
        """The runner of everything queued (torch's ``dw_builder``, called right after the
        input pass): each pass run in the order queued, its closure released once run."""
        queued, self._queued = self._queued, []
        queued.reverse()  # (popped from the end: the first queued runs first)
        self.pending += 1
        self.most_pending = max(self.most_pending, self.pending)
        ran = False

        @torch.no_grad()  # (run outside autograd's backward: its inputs still require grad)
        def run() -> None:
            nonlocal ran
            if not ran:
                ran, self.pending = True, self.pending - 1
            while queued:
                param, grad = queued.pop()
                g = grad()
                self.ran += 1
                param.grad = g if param.grad is None else param.grad.add_(g)

        return run
