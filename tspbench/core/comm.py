"""Counted collectives: every strategy communicates through :class:`Comm`.

Bytes are counted per rank with the nccl-tests bus-traffic convention (method doc section 5),
written once in :func:`bus_bytes` so that the analytic model uses the very same rule:
all-gather / reduce-scatter (D-1)/D of the full tensor, all-reduce 2(D-1)/D, broadcast / reduce
(D-1)/D, send/recv the tensor on the receiver.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "send_recv")


def bus_bytes(kind: str, nbytes: float, size: int) -> float:
    """Bytes one rank moves for a collective over ``size`` ranks of a ``nbytes`` full tensor."""
    if size <= 1:
        return 0.0
    if kind == "send_recv":
        return float(nbytes)
    factor = {"all_reduce": 2.0}.get(kind, 1.0)
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}")
    return factor * (size - 1) / size * nbytes


@dataclass
class CommCounter:
    """Bytes per (mesh axis, collective kind), accumulated until :meth:`reset`."""

    bytes: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))

    def add(self, axis: str, kind: str, nbytes: float) -> None:
        self.bytes[(axis, kind)] += nbytes
        self.calls[(axis, kind)] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def by_kind(self, axes: tuple[str, ...] | None = None) -> dict[str, float]:
        out: dict[str, float] = {}
        for (axis, kind), b in self.bytes.items():
            if axes is None or axis in axes:
                out[kind] = out.get(kind, 0.0) + b
        return out

    def by_axis(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for (axis, _), b in self.bytes.items():
            out[axis] = out.get(axis, 0.0) + b
        return out


class Pending:
    """An in-flight collective; :meth:`wait` returns its result (for overlap with compute)."""

    def __init__(self, work: dist.Work | list[dist.Work] | None, finish: Callable[[], object]):
        self._work = work if isinstance(work, list) else ([work] if work is not None else [])
        self._finish = finish

    @classmethod
    def ready(cls, value: object) -> Pending:
        """An already-finished operation (for code paths that ran it synchronously)."""
        return cls(None, lambda: value)

    def wait(self):
        for w in self._work:
            w.wait()
        return self._finish()


class Comm:
    """Collectives over one process group (one mesh axis), counting bytes as they go.

    Every method takes ``async_op``: False returns the result, True returns a :class:`Pending`.
    A group of size 1 communicates nothing and counts nothing.

    For overlap measurements: with ``trace`` set to a list, every collective appends
    ``(axis, method, shape, dtype, kwargs)`` so a step's communication can be replayed alone;
    with ``skip`` set, collectives return correctly shaped results without communicating (and
    count nothing), so that a step's compute can be timed alone.
    """

    def __init__(
        self, group: dist.ProcessGroup | None, ranks: list[int], axis: str, counter: CommCounter
    ) -> None:
        self.group, self.ranks, self.axis, self.counter = group, ranks, axis, counter
        self.size = len(ranks)
        self.rank = ranks.index(dist.get_rank()) if dist.is_initialized() else 0
        self.trace: list[tuple] | None = None
        self.skip = False
        self.counter_device = torch.device("cpu")

    def _start(
        self, method: str, kind: str, t: torch.Tensor, nbytes_of: torch.Tensor, **kw
    ) -> bool:
        """Count and trace one collective; False when it must not communicate."""
        if self.size == 1:
            return False
        if self.trace is not None:
            self.trace.append((self.axis, method, tuple(t.shape), t.dtype, kw))
            self.counter_device = t.device
        if self.skip:
            return False
        n = nbytes_of.numel() * nbytes_of.element_size()
        self.counter.add(self.axis, kind, bus_bytes(kind, n, self.size))
        return True

    @staticmethod
    def _ret(work, finish, async_op):
        p = Pending(work, finish)
        return p if async_op else p.wait()

    def broadcast(self, t: torch.Tensor, src: int, async_op: bool = False):
        """In place: ``t`` on every rank becomes group-rank ``src``'s ``t``."""
        if not self._start("broadcast", "broadcast", t, t, src=src):
            if self.skip and self.rank != src:
                t.zero_()
            return self._ret(None, lambda: t, async_op)
        w = dist.broadcast(t, self.ranks[src], group=self.group, async_op=True)
        return self._ret(w, lambda: t, async_op)

    def reduce(self, t: torch.Tensor, dst: int, async_op: bool = False):
        """Sum ``t`` into group-rank ``dst``'s ``t`` (other ranks' ``t`` is scratch afterwards)."""
        if not self._start("reduce", "reduce", t, t, dst=dst):
            return self._ret(None, lambda: t, async_op)
        w = dist.reduce(t, self.ranks[dst], group=self.group, async_op=True)
        return self._ret(w, lambda: t, async_op)

    def all_reduce(
        self,
        t: torch.Tensor,
        async_op: bool = False,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    ):
        """In-place reduction (sum by default) over the group."""
        if not self._start("all_reduce", "all_reduce", t, t, op=op):
            return self._ret(None, lambda: t, async_op)
        w = dist.all_reduce(t, op=op, group=self.group, async_op=True)
        return self._ret(w, lambda: t, async_op)

    def all_gather(self, t: torch.Tensor, dim: int, async_op: bool = False):
        """Concatenate every rank's ``t`` along ``dim`` in group-rank order."""
        t = t.contiguous()
        out = t.new_empty((self.size, *t.shape)) if self.size > 1 else None
        if not self._start("all_gather", "all_gather", t, out if out is not None else t, dim=dim):
            if out is None:
                return self._ret(None, lambda: t, async_op)
            out.zero_()
            w = None
        else:
            w = dist.all_gather_single(out.view(-1), t.view(-1), group=self.group, async_op=True)
        return self._ret(w, lambda: out.movedim(0, dim).flatten(dim, dim + 1), async_op)

    def reduce_scatter(self, t: torch.Tensor, dim: int, async_op: bool = False):
        """Sum over the group, then keep block ``rank`` of ``size`` equal blocks along ``dim``."""
        if not self._start("reduce_scatter", "reduce_scatter", t, t, dim=dim):
            if self.size == 1:
                return self._ret(None, lambda: t, async_op)
            block = t.chunk(self.size, dim=dim)[self.rank].clone()
            return self._ret(None, lambda: block, async_op)
        n = t.shape[dim] // self.size
        stacked = t.unflatten(dim, (self.size, n)).movedim(dim, 0).contiguous()
        out = t.new_empty(stacked.shape[1:])
        w = dist.reduce_scatter_single(
            out.view(-1), stacked.view(-1), group=self.group, async_op=True
        )
        return self._ret(w, lambda: out, async_op)

    def ring_exchange(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool = False):
        """Send ``send`` to the next rank and receive the previous rank's into ``recv``."""
        if not self._start("ring_exchange", "send_recv", send, recv):
            recv.copy_(send)
            return self._ret(None, lambda: recv, async_op)
        nxt, prv = self.ranks[(self.rank + 1) % self.size], self.ranks[(self.rank - 1) % self.size]
        ops = [
            dist.P2POp(dist.isend, send.contiguous(), nxt, group=self.group),
            dist.P2POp(dist.irecv, recv, prv, group=self.group),
        ]
        return self._ret(dist.batch_isend_irecv(ops), lambda: recv, async_op)

    def replay(self, method: str, shape: tuple[int, ...], dtype: torch.dtype, kw: dict) -> None:
        """Issue one traced collective again, synchronously, on fresh buffers of its shape."""
        t = torch.zeros(shape, dtype=dtype, device=self.counter_device)
        if method == "ring_exchange":
            self.ring_exchange(t, torch.empty_like(t), **kw)
        else:
            getattr(self, method)(t, **kw)

    def all_reduce_metric(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a reported metric (loss, norms): not training traffic, deliberately not counted."""
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return t
