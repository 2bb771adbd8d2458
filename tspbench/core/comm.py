"""Counted collectives: every strategy communicates through :class:`Comm`.

Bytes are counted per rank with the nccl-tests bus-traffic convention (``docs/method.md`` §6),
written once in :func:`bus_bytes` so that the analytic model uses the very same rule:
all-gather / reduce-scatter (D-1)/D of the full tensor, all-reduce 2(D-1)/D, broadcast / reduce
(D-1)/D, send/recv the tensor on the receiver, all-to-all (D-1)/D of the tensor each rank sends
(its own block stays).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tspbench.core import compat, memory

KINDS = (
    "all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "send_recv", "all_to_all"
)  # fmt: skip


# Collectives for which a backend holds a buffer of its own that the tracker cannot follow, by
# the profiler's allocator events on torch 2.13's gloo: every all-gather stages one the size of
# its output on the worker thread, from the issue until the work completes; every reduce-scatter
# copies its input when issued (through the dispatcher, but Python drops the copy while the
# work holds it) until the wait. Both are counted from the issue to the wait
# (:func:`tspbench.core.memory.charge`: for the all-gather an upper bound). All-reduce,
# broadcast, reduce, all-to-all and send/recv stage nothing; NCCL takes nothing from torch's
# allocator.
STAGED: dict[str, frozenset[str]] = {"gloo": frozenset({"all_gather", "reduce_scatter"})}
_emulated: list[str] = []  # the backend that torch's fake process group stands for


@contextmanager
def emulating(backend: str) -> Iterator[None]:
    """Count, on the fake process group, the staging buffers ``backend`` would allocate (for
    the estimate of a CPU run: gloo's)."""
    _emulated.append(backend)
    try:
        yield
    finally:
        _emulated.pop()


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
        """Bytes per kind over ``axes`` (None: all); an axis's sub-groups (``model.a2a``,
        :meth:`tspbench.core.mesh.Mesh.split`) count as the axis."""
        out: dict[str, float] = {}
        for (axis, kind), b in self.bytes.items():
            if axes is None or axis.split(".")[0] in axes:
                out[kind] = out.get(kind, 0.0) + b
        return out

    def by_axis(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for (axis, _), b in self.bytes.items():
            out[axis] = out.get(axis, 0.0) + b
        return out


_construct = getattr(torch._C, "_construct_storage_from_data_pointer", None)  # (private API)


def _alias(t: torch.Tensor, flat: bool) -> torch.Tensor:
    """``t``'s memory under a storage that owns none of it, for gloo to hold (``flat``: 1-D, of
    a contiguous ``t``).

    Gloo marks a collective complete *before* its worker thread drops the work, and the work
    holds what it was handed; so a buffer the step dropped right after ``wait()`` died on the
    worker's thread a moment later, at random, and the CPU memory tracker counted it at random
    (seen: peaks +7% for tp, +16% for tsp, +30% for sp on some ranks over 15 repeats of tiny
    D = 4 inference steps; in CI +0.2% on a GQA TSP training step, +6% and +4 KiB on TP+SP ring
    steps). Waiting for the worker's references to fall did not close it: torch keeps a
    tensor's Python object alive while C++ holds it, and the worker drops that last, once it
    has the GIL (measured on 2 ranks: 90 of 3000 small buffers still died on the worker). A
    work holding this alias holds no reference to ``t``'s storage, so the step's own thread
    frees every buffer, when the step drops it. The memory must outlive the work itself, which
    gloo runs whether or not anyone waits for it: :class:`Pending` keeps the buffers until its
    wait, and parks them for good if it dies unwaited. (A torch without the private
    constructor gets ``t`` itself: safe, the frees' timing as before.)"""
    if flat and not t.is_contiguous():
        raise ValueError(f"a flat collective needs a contiguous tensor (shape {tuple(t.shape)})")
    if _construct is None:
        return t.view(-1) if flat else t
    shape, stride = ((t.numel(),), (1,)) if flat else (t.shape, t.stride())
    st = t.untyped_storage()
    with memory.unrecorded():  # (nothing allocated: not the step's memory)
        view = _construct(st.data_ptr(), t.device, st.nbytes())
        return t.new_empty(0).set_(view, t.storage_offset(), shape, stride)


def _wait_all(works: Sequence[dist.Work]) -> None:
    for w in works:  # (in a function of its own, so no loop variable outlives the wait)
        w.wait()


_blocked = [0]  # collectives this process's main thread is waiting in


@contextmanager
def blocked_in_collective() -> Iterator[None]:
    """Mark a wait on peers: a watchdog can then tell a rank that hung (no progress outside
    any collective) from one that waits for a peer that hung."""
    _blocked[0] += 1
    try:
        yield
    finally:
        _blocked[0] -= 1


def in_collective() -> bool:
    return _blocked[0] > 0


Work = dist.Work | list[dist.Work]  # what a backend returns for an asynchronous operation
_unwaited: list[tuple[list[dist.Work], Sequence[torch.Tensor]]] = []  # see Pending.__del__


class Pending:
    """An in-flight collective; :meth:`wait` returns its result (for overlap with compute)."""

    def __init__(
        self,
        work: Work | None,
        finish: Callable[[], object],
        keep: Sequence[torch.Tensor] = (),
        release: Callable[[], None] | None = None,
    ):
        self._work = work if isinstance(work, list) else ([work] if work is not None else [])
        self._finish = finish
        self._keep = keep  # the buffers a backend's alias of works on, until the wait
        self._release = release  # the backend's staging buffer, counted until the wait

    @classmethod
    def ready(cls, value: object) -> Pending:
        """An already-finished operation (for code paths that ran it synchronously)."""
        return cls(None, lambda: value)

    def wait(self):
        work, self._work = self._work, []  # (what the works hold is freed where they die)
        # (gloo's wait hands a staged reduce-scatter's copy back through the dispatcher, into
        # the alias: counted by the charge, or the caller's buffer, already)
        quiet = self._release is not None or bool(self._keep)
        try:
            with blocked_in_collective(), memory.unrecorded() if quiet else nullcontext():
                _wait_all(work)
        except BaseException:
            self._work = work  # not known to be finished: see __del__
            raise
        del work
        self._keep = ()
        if self._release is not None:
            self._release, release = None, self._release
            release()
        return self._finish()

    def __del__(self) -> None:
        """Dropped unwaited (an exception unwound past it): gloo may still run the work on its
        alias of the buffers, and a peer's data would land in freed memory (seen: a rank died of
        SIGSEGV or a corrupted heap in 4 of 4 runs of a dropped broadcast). Park the buffers
        for the life of the process; only a failing step gets here."""
        if self._work and self._keep:
            _unwaited.append((self._work, self._keep))


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
        self._backend = dist.get_backend(group) if self.size > 1 and dist.is_initialized() else ""
        self._gloo = self._backend == "gloo"

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

    def _staging(self, kind: str, t: torch.Tensor) -> int:
        """Bytes the backend stages for a ``kind`` collective: ``t`` is an all-gather's output,
        a reduce-scatter's input (:data:`STAGED`)."""
        backend = _emulated[-1] if self._backend == "fake" and _emulated else self._backend
        return t.numel() * t.element_size() if kind in STAGED.get(backend, ()) else 0

    def _issue(
        self, op: Callable, args: tuple, finish, async_op: bool, flat: bool = False,
        staged: int = 0,
    ):  # fmt: skip
        """Issue ``op(*args)`` on this group (``flat``: on 1-D views of ``args``' tensors, which
        must be contiguous) and return its result (or :class:`Pending`), the backend's
        ``staged`` bytes counted until its wait."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]

        def start(given: list[torch.Tensor]) -> Work:
            it = iter(given)
            call = [next(it) if isinstance(a, torch.Tensor) else a for a in args]
            return op(*call, group=self.group, async_op=True)

        return self._pending(start, finish, async_op, tensors, flat, staged)

    def _pending(
        self, start: Callable[[list[torch.Tensor]], Work], finish, async_op: bool,
        buffers: Sequence[torch.Tensor], flat: bool = False, staged: int = 0,
    ):  # fmt: skip
        """Start a work on ``buffers`` and wrap it: ``start`` gets what to hand the backend (on
        gloo the buffers' aliases, :func:`_alias`, while :class:`Pending` keeps the buffers
        until its wait). The work object goes straight to :class:`Pending`, whose ``wait()``
        drops our reference to it (and stops counting the ``staged`` bytes). No frame of ours
        keeps what the backend was handed."""
        if self._gloo:
            given = [_alias(t, flat) for t in buffers]
        else:
            given = [t.view(-1) for t in buffers] if flat else list(buffers)
        release = memory.charge(staged) if staged else None  # counted until the wait
        try:
            with memory.unrecorded():  # (a collective's outputs are buffers counted already)
                pending = Pending(start(given), finish, buffers if self._gloo else (), release)
        except BaseException:
            if release is not None:
                release()
            raise
        given.clear()
        return pending if async_op else pending.wait()

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
        return self._issue(dist.broadcast, (t, self.ranks[src]), lambda: t, async_op)

    def reduce(self, t: torch.Tensor, dst: int, async_op: bool = False):
        """Sum ``t`` into group-rank ``dst``'s ``t`` (other ranks' ``t`` is scratch afterwards)."""
        if not self._start("reduce", "reduce", t, t, dst=dst):
            return self._ret(None, lambda: t, async_op)
        return self._issue(dist.reduce, (t, self.ranks[dst]), lambda: t, async_op)

    def all_reduce(
        self,
        t: torch.Tensor,
        async_op: bool = False,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    ):
        """In-place reduction (sum by default) over the group."""
        if not self._start("all_reduce", "all_reduce", t, t, op=op):
            return self._ret(None, lambda: t, async_op)
        reduce = functools.partial(dist.all_reduce, op=op)
        return self._issue(reduce, (t,), lambda: t, async_op)

    def all_gather(self, t: torch.Tensor, dim: int, async_op: bool = False):
        """Concatenate every rank's ``t`` along ``dim`` in group-rank order."""
        tc = t.contiguous()
        out = t.new_empty((self.size, *t.shape)) if self.size > 1 else None

        def finish():
            return out.movedim(0, dim).flatten(dim, dim + 1)

        if not self._start("all_gather", "all_gather", tc, out if out is not None else tc, dim=dim):
            if out is None:
                return self._ret(None, lambda: tc, async_op)
            out.zero_()
            return self._ret(None, finish, async_op)
        assert out is not None  # size > 1: _start went on
        staged = self._staging("all_gather", out)
        return self._issue(compat.all_gather_flat, (out, tc), finish, async_op, True, staged)

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

        staged = self._staging("reduce_scatter", stacked)
        return self._issue(
            compat.reduce_scatter_flat, (out, stacked), lambda: out, async_op, True, staged
        )

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor) -> None:
        """Every rank's 1-D ``t`` into the 1-D ``out`` in group-rank order, waited for: the
        buffers a library allocated itself (FSDP2's custom all-gather, whose ``t`` is a view of
        ``out``), counted as :meth:`all_gather` counts."""
        if not self._start("all_gather_into", "all_gather", t, out):
            if self.size > 1:
                out.zero_()
            else:
                out.copy_(t)
            return
        staged = self._staging("all_gather", out)
        self._issue(compat.all_gather_flat, (out, t), lambda: out, False, staged=staged)

    def reduce_scatter_into(self, out: torch.Tensor, t: torch.Tensor) -> None:
        """Sum of every rank's 1-D ``t``, block ``rank`` of ``size`` equal blocks into the 1-D
        ``out``, waited for: a library's buffers (FSDP2's custom reduce-scatter), counted as
        :meth:`reduce_scatter` counts."""
        if not self._start("reduce_scatter_into", "reduce_scatter", t, t):
            out.copy_(t.view(self.size, -1)[self.rank] if self.size > 1 else t)
            return
        staged = self._staging("reduce_scatter", t)
        self._issue(compat.reduce_scatter_flat, (out, t), lambda: out, False, staged=staged)

    def all_to_all(self, t: torch.Tensor, async_op: bool = False):
        """Block j of ``size`` equal blocks of ``t`` along dim 0 goes to group-rank j; block j
        of the result came from group-rank j (DeepSpeed-Ulysses' exchange). Counted as
        (D-1)/D of ``t``: what a rank sends and receives, its own block staying."""
        tc = t.contiguous()
        if not self._start("all_to_all", "all_to_all", tc, tc):
            if self.size == 1:
                return self._ret(None, lambda: tc, async_op)
            zeros = torch.zeros_like(tc)
            return self._ret(None, lambda: zeros, async_op)
        out = torch.empty_like(tc)
        return self._issue(compat.all_to_all_flat, (out, tc), lambda: out, async_op, flat=True)

    def all_to_all_v(self, t: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows ``send[j]`` of ``t`` (in order) go to group-rank j and ``recv[j]`` rows come from
        it, in group-rank order (expert-parallel dispatch and combine: uneven, the counts
        exchanged first), waited for. Counted as the bytes this rank sends to the others (its
        own rows stay), the even :meth:`all_to_all`'s rule for uneven blocks."""
        tc = t.contiguous()
        if self.size == 1:
            return tc
        out = tc.new_empty((sum(recv), *tc.shape[1:]))
        if self.trace is not None:
            self.trace.append((self.axis, "all_to_all_v", tuple(tc.shape), tc.dtype,
                               {"send": send, "recv": recv}))  # fmt: skip
            self.counter_device = tc.device
        if self.skip:
            return out.zero_()
        row = math.prod(tc.shape[1:]) * tc.element_size()  # (a rank may send no rows)
        self.counter.add(self.axis, "all_to_all", (sum(send) - send[self.rank]) * row)
        op = functools.partial(
            compat.all_to_all_flat, output_split_sizes=recv, input_split_sizes=send
        )
        return self._issue(op, (out, tc), lambda: out, False)

    def ring_exchange(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool = False):
        """Send ``send`` to the next rank and receive the previous rank's into ``recv``."""
        if not self._start("ring_exchange", "send_recv", send, recv):
            recv.copy_(send)
            return self._ret(None, lambda: recv, async_op)
        nxt, prv = self.ranks[(self.rank + 1) % self.size], self.ranks[(self.rank - 1) % self.size]

        def start(given: list[torch.Tensor]) -> Work:
            return dist.batch_isend_irecv([
                dist.P2POp(dist.isend, given[0], nxt, group=self.group),
                dist.P2POp(dist.irecv, given[1], prv, group=self.group),
            ])  # fmt: skip

        return self._pending(start, lambda: recv, async_op, (send.contiguous(), recv))

    def replay(self, method: str, shape: tuple[int, ...], dtype: torch.dtype, kw: dict) -> None:
        """Issue one traced collective again, synchronously, on fresh buffers of its shape."""
        t = torch.zeros(shape, dtype=dtype, device=self.counter_device)
        if method == "ring_exchange":
            self.ring_exchange(t, torch.empty_like(t), **kw)
        elif method == "all_gather_into":
            self.all_gather_into(t.new_zeros(t.numel() * self.size), t)
        elif method == "reduce_scatter_into":
            self.reduce_scatter_into(t.new_zeros(t.numel() // self.size), t)
        else:
            getattr(self, method)(t, **kw)

    def all_reduce_metric(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a reported metric (loss, norms): not training traffic, deliberately not counted."""
        if self.size > 1:
            self._issue(dist.all_reduce, (t,), lambda: t, False)
        return t
