"""Prefetching: issue step i+1's communication before step i's compute (double buffering).

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


def owner_shards(w_own: torch.Tensor, comm: Comm, overlap: bool = True):
    """Yield (r, owner r's shard) for r = 0..D-1 by broadcast, the next one in flight."""

    def start(r: int) -> Pending:
        w = w_own if r == comm.rank else torch.empty_like(w_own)
        return comm.broadcast(w, src=r, async_op=True)

    return prefetched(comm.size, start, overlap)
