"""TSP gated MLP: the ring schedule (method doc section 4).

Rank p owns slice p of the intermediate dimension, packed as W_p = [W1_p; W3_p; W2_p^T]
([3f/D, h]). Forward: for D steps each rank applies the slice it holds to its own tokens,
    Y_p += (silu(X_p W1_s) * (X_p W3_s)) W2_s,
while passing that slice to rank p+1 and receiving the next from rank p-1 (point-to-point; the
transfer is started before the GEMMs and waited for after them). No activation moves.

Backward: the slices circulate again in the same order; a gradient accumulator travels with each
slice and every rank adds its own tokens' contribution. After D steps and one last hop of the
accumulator, each accumulator is back home holding its owner's full dW. dX_p accumulates locally.
Per step: forward D-1 slice hops; backward D-1 slice hops and D accumulator hops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tspbench.core.comm import Comm
from tspbench.core.layers import silu_grad


def split_slice(w: torch.Tensor):
    """(W1_s, W3_s, W2_s^T) views of a packed slice."""
    return w.chunk(3, dim=0)


class RingMLP(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x: torch.Tensor, w_own: torch.Tensor, comm: Comm):  # type: ignore[override]
        save = any(fctx.needs_input_grad)
        y = torch.zeros_like(x)
        cur, saved = w_own, []
        for t in range(comm.size):
            nxt = None
            if t < comm.size - 1:  # start the next slice's transfer, then compute on this one
                nxt = comm.ring_exchange(cur, torch.empty_like(cur), async_op=True)
            w1, w3, w2t = split_slice(cur)
            h1, h3 = x @ w1.T, x @ w3.T
            y += (F.silu(h1) * h3) @ w2t
            if save:
                saved += [h1, h3]
            if nxt is not None:
                cur = nxt.wait()
        fctx.comm = comm
        if save:
            fctx.save_for_backward(x, w_own, *saved)
        return y

    @staticmethod
    def backward(fctx, dy: torch.Tensor):  # type: ignore[override]
        comm: Comm = fctx.comm
        x, w_own, *saved = fctx.saved_tensors
        dx = torch.zeros_like(x)
        x2, dy2 = x.flatten(0, 1), dy.flatten(0, 1)
        cur, acc = w_own, torch.zeros_like(w_own)
        for t in range(comm.size):
            nxt = None
            if t < comm.size - 1:
                nxt = comm.ring_exchange(cur, torch.empty_like(cur), async_op=True)
            w1, w3, w2t = split_slice(cur)
            h1, h3 = saved[2 * t], saved[2 * t + 1]
            s = F.silu(h1)
            dg = dy @ w2t.T
            dh1, dh3 = dg * h3 * silu_grad(h1), dg * s
            dx += dh1 @ w1 + dh3 @ w3
            acc += torch.cat(
                [dh1.flatten(0, 1).T @ x2, dh3.flatten(0, 1).T @ x2, (s * h3).flatten(0, 1).T @ dy2]
            )
            acc = comm.ring_exchange(acc, torch.empty_like(acc))  # travels with its slice
            if nxt is not None:
                cur = nxt.wait()
        return dx, acc, None
