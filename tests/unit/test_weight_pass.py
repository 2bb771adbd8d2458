"""TSP's deferred weight passes (tsp_impl/weight_pass.py): what an input pass queues runs only
when the schedule calls the runner built after it, in the order queued, into ``.grad``."""

from __future__ import annotations

import pytest
import torch

from tsp_impl import mlp
from tsp_impl.overlap import owner_shards
from tsp_impl.weight_pass import WeightPass, deferring, drained
from tspbench.core.comm import Comm, CommCounter
from tspbench.core.memory import MemoryTracker


def test_a_runner_runs_its_input_pass_queue_in_order_and_accumulates():
    w, v = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    wp, order = WeightPass(), []

    def grad(name: str, t: torch.Tensor):
        def run() -> torch.Tensor:
            order.append(name)
            assert not torch.is_grad_enabled()  # (outside autograd: no graph for dW)
            return t.clone()

        return run

    deferring(wp, w)(grad("w1", torch.ones(2)))
    wp.defer(v, grad("v", torch.full((3,), 2.0)))
    first = wp.take()  # (torch's dw_builder, right after micro-batch 0's input pass)
    deferring(wp, w)(grad("w2", torch.full((2,), 3.0)))
    second = wp.take()
    assert order == [] and w.grad is None  # nothing runs before the W actions
    assert wp.pending == wp.most_pending == 2
    with pytest.raises(RuntimeError, match="2 micro-batches' never run"):
        wp.check_done()  # (a schedule ending here would leave w and v without gradients)
    second()  # (the schedule may run a later micro-batch's W first)
    first()
    assert order == ["w2", "w1", "v"] and wp.ran == 3 and wp.pending == 0
    wp.check_done()
    assert torch.equal(w.grad, torch.full((2,), 4.0)) and torch.equal(v.grad, torch.full((3,), 2.0))
    first()  # a runner runs its queue once
    assert wp.ran == 3 and wp.pending == 0
    deferring(wp, w)(grad("w3", torch.ones(2)))  # (queued outside an input pass: never taken)
    with pytest.raises(RuntimeError, match="1 queued outside an input pass"):
        wp.check_done()
    assert deferring(None, w) is None  # (no schedule's split: the backward runs its weight pass)


def test_drained_hands_out_in_order_and_keeps_nothing():
    parts = [1, 2, 3]
    out = []
    for x in drained(parts):
        out.append(x)
        assert len(parts) == 3 - len(out)
    assert out == [1, 2, 3] and parts == []


@pytest.mark.parametrize("schedule", ["ring", "broadcast"])
@pytest.mark.parametrize("overlap", [True, False])
def test_the_mlp_backward_split_or_whole_gives_the_same_gradients_and_transients(schedule, overlap):
    """On one rank (D = 1: no process group), the whole backward and its two passes give the
    same dX and dW; the whole one's transient peak is the unsplit loop's: the ring's, its
    accumulator and receive buffer beside dX (the step's dh and g freed before the buffer is
    taken); the broadcast's, dW beside dh, g and dX."""
    torch.manual_seed(0)
    t, h, f, e = 16, 64, 512, 4
    x, dy = torch.randn(2, t // 2, h), torch.randn(2, t // 2, h)
    w = torch.randn(3 * f, h) * 0.05
    comm = Comm(None, [0], "model", CommCounter())
    shards = mlp.ring if schedule == "ring" else owner_shards
    backward = mlp.ring_mlp_backward if schedule == "ring" else mlp.broadcast_mlp_backward
    _, saved = mlp.mlp_forward(x, x, shards(w, comm, overlap), True, False)
    with MemoryTracker() as tracker:
        tracker.track(x, w, dy, saved)
        base = tracker.live
        dx, dw = backward(dy, x, w, saved, comm, overlap)
    u = w.numel() * e
    whole = 2 * u + t * h * e if schedule == "ring" else u + t * (3 * f + h) * e
    assert tracker.peak - base == whole
    deferred: list = []
    dx2, none = backward(dy, x, w, saved, comm, overlap, defer=deferred.append)
    assert none is None and len(deferred) == 1
    assert torch.equal(dx2, dx) and torch.equal(deferred[0](), dw)
