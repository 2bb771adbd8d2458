"""TSP gated MLP: the ring schedule (``docs/method.md`` §4).

Rank p owns slice p of the intermediate dimension, packed as W_p = [W1_p; W3_p; W2_p^T]
([3f/D, h]). Forward: for D steps each rank applies the slice it holds to its own tokens,
    Y_p += (silu(X_p W1_s) * (X_p W3_s)) W2_s,
while passing that slice to rank p+1 and receiving the next from rank p-1 (point-to-point,
started before the GEMMs, waited for after them). No activation moves.

Backward: the slices circulate again in the same order; a gradient accumulator travels one hop
behind each slice: every rank computes its own tokens' contribution to the slice it holds, adds
it to the accumulator arriving for that slice and sends it on, while the next step computes.
After D steps and one last hop each accumulator is home with its owner's full dW; dX_p
accumulates locally. Per step: forward D-1 slice hops; backward D-1 slice hops, D accumulator hops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tspbench.core.comm import Comm, Pending
from tspbench.core.layers import silu_grad


def split_slice(w: torch.Tensor):
    """(W1_s, W3_s, W2_s^T) views of a packed slice."""
    return w.chunk(3, dim=0)


def ring(w_own: torch.Tensor, comm: Comm, overlap: bool):
    """Yield (t, slice held at step t) for t = 0..D-1; with overlap the next hop is in flight
    while the caller computes (at most two slices alive: the one in use, the one arriving)."""
    cur = w_own
    for t in range(comm.size):
        last = t + 1 == comm.size
        nxt = None if last or not overlap else comm.ring_exchange(cur, torch.empty_like(cur), True)
        yield t, cur
        if not last:
            cur = (nxt or comm.ring_exchange(cur, torch.empty_like(cur), True)).wait()


class RingMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w_own: torch.Tensor, comm: Comm, overlap: bool, grad: bool):  # type: ignore[override]
        save = grad and any(ctx.needs_input_grad)  # (needs_input_grad ignores no_grad)
        y = torch.zeros_like(x)
        saved = []
        for _, w in ring(w_own, comm, overlap):
            w1, w3, w2t = split_slice(w)
            h1, h3 = x @ w1.T, x @ w3.T
            y += (F.silu(h1) * h3) @ w2t
            if save:
                saved += [h1, h3]
        ctx.comm, ctx.overlap = comm, overlap
        if save:
            ctx.save_for_backward(x, w_own, *saved)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        comm: Comm = ctx.comm
        x, w_own, *saved = ctx.saved_tensors
        dx = torch.zeros_like(x)
        x2, dy2 = x.flatten(0, 1), dy.flatten(0, 1)
        arriving = None  # the accumulator for the slice held now, in flight from rank p-1
        for t, w in ring(w_own, comm, ctx.overlap):
            w1, w3, w2t = split_slice(w)
            h1, h3 = saved[2 * t], saved[2 * t + 1]
            s = F.silu(h1)
            dg = dy @ w2t.T
            dh1, dh3 = dg * h3 * silu_grad(h1), dg * s
            dx += dh1 @ w1 + dh3 @ w3
            acc = torch.cat(
                [dh1.flatten(0, 1).T @ x2, dh3.flatten(0, 1).T @ x2, (s * h3).flatten(0, 1).T @ dy2]
            )
            if arriving is not None:
                acc += arriving.wait()
            arriving = comm.ring_exchange(acc, torch.empty_like(acc), async_op=True)
            if not ctx.overlap:
                arriving = Pending.ready(arriving.wait())
        return dx, arriving.wait(), None, None, None
