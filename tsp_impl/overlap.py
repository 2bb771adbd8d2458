"""Prefetching: issue step i+1's communication before step i's compute (double buffering);
draining: at most one gradient reduce in flight behind the compute (:class:`OneInFlight`).

``prefetched(n, start, overlap)`` yields ``(i, start(i).wait())`` for i in 0..n-1. With overlap
on, ``start(i + 1)`` is issued before step i is handed to the caller, so the transfer runs while
the caller computes; with overlap off, it is issued only after the caller is done with step i.
Either way every rank issues the same collectives in the same order, and at most two steps'
buffers (the one in use and the one in flight) are alive.

On CUDA the async collectives run on the process group's own communication stream; ``wait()``
makes the compute stream wait on it, so kernels and NCCL run concurrently without extra streams.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from tspbench.core.comm import Comm, Pending


def prefetched(
    n: int, start: Callable[[int], Pending], overlap: bool = True
) -> Iterator[tuple[int, object]]:
    if n == 0:
        return
    pending = start(0)
    for i in range(n):
        result = pending.wait()
        if overlap and i + 1 < n:
            pending = start(i + 1)
        yield i, result
        if not overlap and i + 1 < n:
            pending = start(i + 1)


def receive_buffers(like: torch.Tensor, overlap: bool) -> Callable[[int], torch.Tensor]:
    """``buffer(i)``: where transfer i lands. With overlap, two buffers like ``like`` used in
    turn (transfers i and i+1 are never in the same one, and i-1's is done with by then);
    without, a fresh buffer each time (freed once used)."""
    slots: list[torch.Tensor | None] = [None, None]

    def buffer(i: int) -> torch.Tensor:
        if not overlap:
            return torch.empty_like(like)
        slot = slots[i % 2]
        if slot is None:
            slot = slots[i % 2] = torch.empty_like(like)
        return slot

    return buffer


def owner_shards(w_own: torch.Tensor, comm: Comm, overlap: bool = True):
    """Yield (r, owner r's shard) for r = 0..D-1 by broadcast, the next one in flight.

    With overlap, the shards are received into two buffers used in turn (double buffering:
    shard r+1 arrives in the one shard r-1 was in, which step r-1's compute is done with), so a
    pass allocates two buffers, not D-1. Without overlap each shard gets a fresh buffer, freed
    after its step: only the one in use is alive."""
    buffer = receive_buffers(w_own, overlap)

    def start(r: int) -> Pending:
        return comm.broadcast(w_own if r == comm.rank else buffer(r), src=r, async_op=True)

    return prefetched(comm.size, start, overlap)


class OneInFlight:
    """Gradient reduces to their owners, at most one in flight: each :meth:`reduce` first waits
    for the one before it (which drained while this step computed), so only two gradients are
    alive, the one in flight and the one just computed. Every schedule whose backward reduces a
    gradient per owner uses it; the ring MLP's accumulator hops are another pattern.

    ``wait_each`` waits for every reduce as soon as it is issued (the broadcast MLP with overlap
    off); the reduce is still issued ``async_op=True``, as before, so the trace is the same."""

    def __init__(self, comm: Comm, wait_each: bool = False) -> None:
        self.comm, self.wait_each = comm, wait_each
        self.pending: Pending | None = None

    def reduce(self, t: torch.Tensor, dst: int) -> None:
        """Sum ``t`` into owner ``dst``'s, once the previous reduce is done."""
        if self.pending is not None:
            self.pending.wait()
        self.pending = self.comm.reduce(t, dst=dst, async_op=True)
        if self.wait_each:
            self.pending = Pending.ready(self.pending.wait())

    def drain(self) -> None:
        """Wait for the reduce still in flight (the pass's last)."""
        if self.pending is not None:
            self.pending.wait()
