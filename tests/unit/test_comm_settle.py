"""Gloo marks a collective complete before its worker thread lets go of the work (and with it
the buffers); the memory tracker must not see that lag. :meth:`Pending.wait` returns once the
work is really gone, whatever the caller did with the buffer meanwhile (a thread stands in for
gloo's worker)."""

from __future__ import annotations

import threading
import time

import torch

from tspbench.core.comm import Pending, _refs


class _Work:
    """A complete work that holds a view of its buffer until it is destroyed, like gloo's."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf.view(-1)

    def wait(self) -> None:
        pass


def _in_flight(t: torch.Tensor, lag: float) -> tuple[Pending, tuple[int, int]]:
    """A pretend collective on ``t`` whose worker drops the work ``lag`` s after it is issued."""
    before = _refs(t)
    worker = [_Work(t)]
    rose = tuple(n > b for n, b in zip(_refs(t), before))  # (a view holds its base and storage)
    pending = Pending(list(worker), lambda: t, held=[(t, rose)])
    threading.Thread(target=lambda: (time.sleep(lag), worker.clear())).start()
    return pending, before


def test_wait_returns_once_the_worker_let_go():
    t = torch.zeros(1024)
    pending, before = _in_flight(t, lag=0.05)
    pending.wait()
    assert _refs(t) == before


def test_references_the_caller_takes_meanwhile_do_not_stall_the_wait():
    t = torch.zeros(1024)
    pending, before = _in_flight(t, lag=0.05)
    mine = t[:10]  # the caller's own view, taken while the collective is in flight
    start = time.monotonic()
    pending.wait()
    assert time.monotonic() - start < 0.5  # not the 1 s give-up bound
    assert _refs(t)[1] == before[1] + 1  # the work's view is gone, the caller's is left
    del mine
