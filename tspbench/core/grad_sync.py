"""Data-parallel gradient all-reduce in buckets, overlapped with the backward pass (DDP-style).

Parameters are grouped, in reverse order (the backward produces the last layers' gradients
first), into buckets of about ``bucket_bytes``. A post-accumulate-grad hook counts each bucket's
finished gradients; the moment a bucket is complete its packed all-reduce is issued
asynchronously, while the backward goes on with earlier layers. ``finish()`` waits for all of
them and copies the sums back. Every replica runs the same model code, so every replica issues
the buckets in the same order.
"""

from __future__ import annotations

import torch

from tspbench.core.comm import Comm, Pending


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    """``p``'s gradient: set once its bucket is launched (the hook counts only set ones)."""
    assert p.grad is not None
    return p.grad


class BucketedAllReduce:
    def __init__(self, params: list[torch.nn.Parameter], comm: Comm, bucket_bytes: int) -> None:
        self.comm = comm
        self.buckets: list[list[torch.nn.Parameter]] = [[]]
        size = 0
        for p in reversed(params):
            if size >= bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.ready = [0] * len(self.buckets)
        self.pending: list[tuple[torch.Tensor, Pending] | None] = [None] * len(self.buckets)
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if p.grad is None:  # autograd passed no gradient: the strategy assigns it later
            return
        i = self.bucket_of[id(p)]
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]):
            self._launch(i)

    def grad_ready(self, p: torch.nn.Parameter) -> None:
        """Count ``p``'s gradient as final, as the hook does: for a strategy that assigns a
        gradient itself rather than through autograd's accumulation (FSDP+CP, whose
        asynchronous reduce-scatters finish after their autograd node returned none)."""
        self._on_grad(p)

    def _launch(self, i: int) -> None:
        flat = torch.cat([_grad(p).flatten() for p in self.buckets[i]])
        self.pending[i] = (flat, self.comm.all_reduce(flat, async_op=True))

    def finish(self) -> None:
        """Wait for every bucket's sum (issuing any not yet complete, in order) and apply it."""
        for i, bucket in enumerate(self.buckets):
            if self.pending[i] is None:
                for p in bucket:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                self._launch(i)
        for i, bucket in enumerate(self.buckets):
            launched = self.pending[i]
            assert launched is not None  # every bucket was launched just above
            flat, work = launched
            work.wait()
            grads = [_grad(p) for p in bucket]
            parts = flat.split([g.numel() for g in grads])
            torch._foreach_copy_(grads, [f.view_as(g) for g, f in zip(grads, parts)])
        self.ready = [0] * len(self.buckets)
        self.pending = [None] * len(self.buckets)
