"""TSP's deferred weight passes (tsp_impl/weight_pass.py): what an input pass queues runs only
when the schedule calls the runner built after it, in the order queued, into ``.grad``."""

from __future__ import annotations

import torch

from tsp_impl.weight_pass import WeightPass, deferring, drained


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
    second()  # (the schedule may run a later micro-batch's W first)
    first()
    assert order == ["w2", "w1", "v"] and wp.ran == 3
    assert torch.equal(w.grad, torch.full((2,), 4.0)) and torch.equal(v.grad, torch.full((3,), 2.0))
    first()  # a runner runs its queue once
    assert wp.ran == 3
    assert deferring(None, w) is None  # (no schedule's split: the backward runs its weight pass)


def test_drained_hands_out_in_order_and_keeps_nothing():
    parts = [1, 2, 3]
    out = []
    for x in drained(parts):
        out.append(x)
        assert len(parts) == 3 - len(out)
    assert out == [1, 2, 3] and parts == []
