"""TSP gated MLP: the ring and the broadcast schedules (``docs/method.md`` §4).

Rank p owns slice p of the intermediate dimension, packed as W_p = [W1_p; W3_p; W2_p^T]
([3f/D, h]). Both schedules apply every slice s to the rank's own tokens, in D steps,
    Y_p += (silu(X_p W1_s) * (X_p W3_s)) W2_s,
accumulate Y_p and dX_p locally (no activation moves, nothing is all-reduced) and save h1, h3 of
every slice; they differ in how the slices and their gradients move.

Ring (``RingMLP``): each rank passes the slice it holds to rank p+1 and receives the next from
rank p-1 (point-to-point, started before the GEMMs, waited for after them). Backward: the slices
circulate again in the same order; a gradient accumulator travels one hop behind each slice:
every rank adds its tokens' contribution to the slice it holds to the accumulator arriving for
that slice and sends it on, while the next step computes. After D steps and one last hop each
accumulator is home with its owner's full dW. Every hop uses one link.

Broadcast (``BroadcastMLP``), the loop of the broadcast attention: at step s the owner of slice s
broadcasts it (the broadcast of s+1 is in flight meanwhile: two slices alive). Backward: the
slices are broadcast again in the same order; every rank computes its tokens' contribution to
dW_s and a reduce sums the contributions on owner s (asynchronous: it drains while the next step
computes, at most one in flight). A broadcast is one collective from one owner to D-1 peers: on a
fully connected mesh it can use every link at once.

Bytes per rank and layer, as :class:`tspbench.core.comm.Comm` counts them (``bus_bytes``: a
send/recv counts its tensor, a broadcast or reduce (D-1)/D of it), with Wm = 3 h f e the layer's
MLP weights and Wm/D one slice:

    ring       forward  D-1 send_recv of Wm/D      = (D-1)/D Wm
               backward 2D-1 send_recv of Wm/D     = (2D-1)/D Wm   (D-1 slice, D accumulator hops)
    broadcast  forward  D broadcasts of Wm/D       = (D-1)/D Wm    (the ring's bytes)
               backward D broadcasts + D reduces   = 2(D-1)/D Wm   (the ring's less Wm/D)

With recompute = full the forward's bytes come once more in backward. With overlap off, every
transfer is waited for as soon as it is issued (the broadcast of the next slice starts after the
step's compute).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tsp_impl.overlap import owner_shards
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


def slice_grad(dx, x, dy, w, h1, h3) -> torch.Tensor:
    """The SiLU-gated backward of one slice ``w`` on this rank's tokens: adds their dX into
    ``dx`` and returns their contribution to the packed dW of the slice. Its [t, f/D] buffers are
    freed on return, before the caller waits on any transfer."""
    w1, w3, w2t = split_slice(w)
    x2, dy2 = x.flatten(0, 1), dy.flatten(0, 1)
    s = F.silu(h1)
    dg = dy @ w2t.T
    dh1, dh3 = dg * h3 * silu_grad(h1), dg * s
    dx += dh1 @ w1 + dh3 @ w3
    return torch.cat(
        [dh1.flatten(0, 1).T @ x2, dh3.flatten(0, 1).T @ x2, (s * h3).flatten(0, 1).T @ dy2]
    )


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


class BroadcastMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w_own: torch.Tensor, comm: Comm, overlap: bool, grad: bool):  # type: ignore[override]
        save = grad and any(ctx.needs_input_grad)  # (needs_input_grad ignores no_grad)
        y = torch.zeros_like(x)
        saved = []
        for _, w in owner_shards(w_own, comm, overlap):
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
        dw_own, reducing = None, None
        for s, w in owner_shards(w_own, comm, ctx.overlap):
            dw = slice_grad(dx, x, dy, w, saved[2 * s], saved[2 * s + 1])
            if reducing is not None:  # at most one gradient reduce in flight
                reducing.wait()
            reducing = comm.reduce(dw, dst=s, async_op=True)
            if not ctx.overlap:
                reducing = Pending.ready(reducing.wait())
            if s == comm.rank:
                dw_own = dw
        reducing.wait()
        return dx, dw_own, None, None, None
