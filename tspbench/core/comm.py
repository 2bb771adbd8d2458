"""Counted collectives: every strategy communicates through :class:`Comm`.

Bytes are counted per rank with the nccl-tests bus-traffic convention (``docs/method.md`` §6),
written once in :func:`bus_bytes` so that the analytic model uses the very same rule:
all-gather / reduce-scatter (D-1)/D of the full tensor, all-reduce 2(D-1)/D, broadcast / reduce
(D-1)/D, send/recv the tensor on the receiver, all-to-all (D-1)/D of the tensor each rank sends
(its own block stays).
"""

from __future__ import annotations

import functools
import sys
import time
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


def _refs(t: torch.Tensor) -> tuple[int, int]:
    """References to ``t`` itself (a work holding the very tensor) and to its storage (a work
    holding views of it)."""
    uses = t._use_count()  # type: ignore[attr-defined]  # a C method torch's stubs do not declare
    return uses, torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _wait_all(works: Sequence[dist.Work]) -> None:
    for w in works:  # (in a function of its own, so no loop variable outlives the wait)
        w.wait()


def _settle(
    held: Sequence[tuple[torch.Tensor, tuple[bool, ...]]], works: list, timeout: float = 5.0
) -> None:
    """Drop finished works and wait until gloo's worker thread has let go of them too.

    Gloo marks a collective complete *before* its worker thread drops the work, so a buffer the
    step frees right after ``wait()`` could outlive its last use by a scheduler tick, and the CPU
    memory tracker would count it at random (seen over 15 repeats of tiny D=4 inference steps:
    peaks +7% for tp, +16% for tsp, +30% for sp, on some ranks in some runs; and in CI, +0.2% on
    a GQA TSP training step). A gloo work holds references to its buffers until it is destroyed
    (``held``: each buffer with the counts, of :func:`_refs`, that rose when the work was
    issued), and nothing else changes them while we wait here: so once our last reference to
    the works is gone, every one of those counts falls as soon as the worker's is gone too (all
    of them: a destruction in progress on the worker thread releases them one by one). Usually
    it already is gone, and this costs one check. Bounded: after ``timeout`` s it stops waiting
    (memory accounting only, never correctness) and says so on stderr, since the step's tracked
    peak may then count a buffer the worker still held (suspected, not shown, in two rare
    measured-above-fake peaks on a loaded 2-core machine with a 1 s bound: +0.1% and +6%)."""
    alive = [(t, rose, _refs(t)) for t, rose in held]
    works.clear()
    deadline = None
    for t, rose, counts in alive:
        while not all(n < c for n, c, r in zip(_refs(t), counts, rose) if r):
            deadline = deadline or time.monotonic() + timeout
            if time.monotonic() > deadline:
                print(
                    f"[tspbench] gloo held a collective's buffer over {timeout:g} s after it "
                    "completed: this step's tracked peak may count it",
                    file=sys.stderr,
                    flush=True,
                )
                return
            time.sleep(1e-5)


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


class Pending:
    """An in-flight collective; :meth:`wait` returns its result (for overlap with compute)."""

    def __init__(
        self,
        work: dist.Work | list[dist.Work] | None,
        finish: Callable[[], object],
        held: Sequence[tuple[torch.Tensor, tuple[bool, ...]]] = (),
        release: Callable[[], None] | None = None,
    ):
        self._work = work if isinstance(work, list) else ([work] if work is not None else [])
        self._finish = finish
        self._held = held
        self._release = release  # the backend's staging buffer, counted until the wait

    @classmethod
    def ready(cls, value: object) -> Pending:
        """An already-finished operation (for code paths that ran it synchronously)."""
        return cls(None, lambda: value)

    def wait(self):
        work, self._work = self._work, []  # the work objects hold the buffers too: let go
        # (gloo's wait hands a staged reduce-scatter's copy back through the dispatcher:
        # counted by the charge already)
        with blocked_in_collective(), memory.unrecorded() if self._release else nullcontext():
            _wait_all(work)
        _settle(self._held, work)
        self._held = ()
        if self._release is not None:
            self._release, release = None, self._release
            release()
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
        """Issue ``op(*args)`` on this group (``flat``: on 1-D views of ``args``) and return its
        result (or :class:`Pending`), the backend's ``staged`` bytes counted until its wait.
        The views are temporaries, so no frame of ours keeps the buffers alive."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]

        def start():
            return op(*[a.view(-1) for a in tensors] if flat else args, group=self.group,
                      async_op=True)  # fmt: skip

        return self._pending(start, finish, async_op, tensors, staged)

    def _pending(
        self, start: Callable, finish, async_op: bool, buffers: Sequence[torch.Tensor],
        staged: int = 0,
    ):  # fmt: skip
        """Start a work and wrap it; on gloo, note the references it holds to ``buffers`` for
        :func:`_settle`. The work object goes straight to :class:`Pending`, whose ``wait()``
        drops the last reference to it (and stops counting the ``staged`` bytes)."""
        before = [_refs(t) for t in buffers] if self._gloo else []
        if staged:  # the staging buffer, counted from here to the wait, and nothing else
            release = memory.charge(staged)
            try:
                with memory.unrecorded():
                    pending = Pending(start(), finish, release=release)
            except BaseException:
                release()
                raise
        else:
            pending = Pending(start(), finish)
        if self._gloo:  # the buffers the work took references to, and which counts rose
            rose = [
                (t, tuple(n > b for n, b in zip(_refs(t), was))) for t, was in zip(buffers, before)
            ]
            pending._held = [(t, r) for t, r in rose if any(r)]
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

    def ring_exchange(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool = False):
        """Send ``send`` to the next rank and receive the previous rank's into ``recv``."""
        if not self._start("ring_exchange", "send_recv", send, recv):
            recv.copy_(send)
            return self._ret(None, lambda: recv, async_op)
        nxt, prv = self.ranks[(self.rank + 1) % self.size], self.ranks[(self.rank - 1) % self.size]
        send = send.contiguous()
        ops = [
            dist.P2POp(dist.isend, send, nxt, group=self.group),
            dist.P2POp(dist.irecv, recv, prv, group=self.group),
        ]
        return self._pending(
            lambda: dist.batch_isend_irecv(ops), lambda: recv, async_op, (send, recv)
        )

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
            with blocked_in_collective():
                dist.all_reduce(t, group=self.group)
        return t
