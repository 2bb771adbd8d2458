"""TSP gated MLP: the ring and the broadcast schedules (``docs/method.md`` §4).

Rank p owns slice p of the intermediate dimension, packed as W_p = [W1_p; W3_p; W2_p^T]
([3f/D, h]; with Llama's mlp_bias, [b1_p; b3_p] in zero-padded rows after them: ``bias_rows``).
Both schedules apply every slice s to the rank's own tokens, in D steps,
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

Packing: W1_s and W3_s are adjacent rows of the slice, so h1 and h3 are one GEMM into one
[t, 2f/D] tensor (saved as is), and in backward [dh1 dh3] is one tensor, so dX and the
[dW1; dW3] rows are one GEMM each; the packed gradient is written in place by its GEMMs. The
layer's residual input starts the accumulation of Y (the Functions return residual + MLP). With
overlap, received slices alternate between two buffers and the ring's accumulators take turns in
three, so the steps allocate no buffers. In a recomputed forward (``recompute``) only h1, h3 are
needed: the SiLU gate and the W2 GEMM are skipped, as autograd's recompute of a plain layer skips
them.

Each schedule is plain functions (the forward ``mlp_forward`` over the schedule's slice
iterator, ``ring`` or ``owner_shards``; ``ring_mlp_backward``, ``broadcast_mlp_backward``)
under a thin autograd.Function (``RingMLP``, ``BroadcastMLP``) that keeps h13 on its ctx.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

from tsp_impl.ops import accumulate
from tsp_impl.overlap import OneInFlight, owner_shards, receive_buffers
from tsp_impl.weight_pass import Defer, WeightPass, deferring, drained
from tspbench.core.comm import Comm, Pending

Part = tuple[int, list[torch.Tensor]]  # (step or slice s, [its dh, its g]): its weight pass


def ring(w_own: torch.Tensor, comm: Comm, overlap: bool):
    """Yield (t, slice held at step t) for t = 0..D-1; with overlap the next hop is in flight
    while the caller computes (two slices alive: the one in use, the one arriving, received into
    two buffers in turn: the one arriving never is the one being sent)."""
    buffer = receive_buffers(w_own, overlap)
    cur = w_own
    for t in range(comm.size):
        last = t + 1 == comm.size
        nxt = None if last or not overlap else comm.ring_exchange(cur, buffer(t), True)
        yield t, cur
        if not last:
            cur = (nxt or comm.ring_exchange(cur, buffer(t), True)).wait()


def bias_rows(n: int, h: int) -> int:
    """Rows of width h that carry a slice's [b1_s; b3_s] (Llama's mlp_bias, 2n elements) after
    its 3n weight rows, zero-padded: one transfer moves them with the weights."""
    return -(-2 * n // h)


def width(w: torch.Tensor, bias: bool) -> int:
    """n = f/D of a packed slice ``w``: its rows are 3n, and ``bias_rows`` more with biases."""
    rows, h = w.shape
    n = rows // 3
    while bias and 3 * n + bias_rows(n, h) > rows:
        n -= 1
    return n


def biases(w: torch.Tensor, n: int) -> torch.Tensor:
    """[b1_s; b3_s] of a packed slice with biases (a view of its last rows)."""
    return w[3 * n :].flatten()[: 2 * n]


def slice_fwd(y, x2, w, recompute: bool, res, bias: bool = False):
    """h13 = X [W1_s; W3_s]^T (+ [b1_s; b3_s]) ([t, 2f/D], what backward needs) and, unless
    recomputing, y + (silu(h1) * h3) W2_s (y None: the residual ``res`` + ...)."""
    n = width(w, bias)
    h13 = x2 @ w[: 2 * n].T if not bias else torch.addmm(biases(w, n), x2, w[: 2 * n].T)
    if not recompute:
        y = accumulate(y, F.silu(h13[:, :n]).mul_(h13[:, n:]), w[2 * n : 3 * n], res)
    return y, h13


def slice_bwd(dx, dy2, w, h13, bias: bool = False):
    """The SiLU-gated backward of one slice ``w`` on this rank's tokens: dX (accumulated into
    ``dx``), dh = [dh1 dh3] [t, 2f/D] and g = silu(h1) * h3 for the packed gradient."""
    n = width(w, bias)
    h1, h3 = h13[:, :n], h13[:, n:]
    dg = dy2 @ w[2 * n : 3 * n].T
    s = F.silu(h1)
    dh = torch.cat([torch.ops.aten.silu_backward(h3, h1), s], dim=1)  # [h3 silu'(h1), silu(h1)]
    dh.view(-1, 2, n).mul_(dg.unsqueeze(1))
    del dg
    return accumulate(dx, dh, w[: 2 * n]), dh, s.mul_(h3)


def slice_grad(out, dh, g, x2, dy2) -> torch.Tensor:
    """Write the packed [dh^T X; g^T dY] (= [dW1; dW3; dW2^T]) into ``out``, and where it has
    bias rows, [db1; db3] (the column sums of dh), then zeros."""
    n = g.shape[1]
    torch.mm(dh.T, x2, out=out[: 2 * n])
    torch.mm(g.T, dy2, out=out[2 * n : 3 * n])
    if out.shape[0] > 3 * n:
        rest = out[3 * n :].view(-1)
        torch.sum(dh, dim=0, out=rest[: 2 * n])
        rest[2 * n :].zero_()
    return out


def mlp_forward(
    res: torch.Tensor, x: torch.Tensor, shards, save: bool, recompute: bool, bias: bool = False
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(res + MLP(x), the h13 of every slice if ``save``) for either schedule over ``shards``
    (its (step, slice) iterator: :func:`ring` or :func:`~tsp_impl.overlap.owner_shards`)."""
    B, n, h = x.shape
    x2, y, saved = x.view(B * n, h), None, []
    for _, w in shards:
        y, h13 = slice_fwd(y, x2, w, recompute, res.view(B * n, h), bias)
        if save:
            saved.append(h13)
        del h13  # (not alive while the next slice's is computed)
    if recompute:  # the output is never used (autograd stops once the saved tensors are back)
        return torch.empty_like(x), saved
    assert y is not None  # (D >= 1 slices)
    return y.view(B, n, h), saved


def ring_mlp_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    w_own: torch.Tensor,
    saved: list[torch.Tensor],
    comm: Comm,
    overlap: bool,
    bias: bool = False,
    defer: Defer | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dX, this rank's packed dW): the slices circulate again, each one's gradient accumulator
    one hop behind it, home with its owner after the last hop; with ``defer`` (a zero-bubble
    schedule's input pass) the accumulators' pass is handed to it, and dW is None."""
    return _backward(ring, ring_grads, dy, x, w_own, saved, comm, overlap, bias, defer)


def _backward(
    shards: Callable[[torch.Tensor, Comm, bool], Iterator[tuple[int, torch.Tensor]]],
    grads: Callable[..., torch.Tensor],
    dy: torch.Tensor,
    x: torch.Tensor,
    w_own: torch.Tensor,
    saved: list[torch.Tensor],
    comm: Comm,
    overlap: bool,
    bias: bool,
    defer: Defer | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Either schedule's backward: the input pass over ``shards`` (the slices as they come,
    dX accumulated, each step's (dh, g) handed on) and the weight pass ``grads`` over them,
    behind it step by step, or later (``defer``)."""
    B, n, h = x.shape
    x2, dy2 = x.view(B * n, h), dy.reshape(B * n, h)
    dx: torch.Tensor | None = None

    def input_pass() -> Iterator[Part]:
        nonlocal dx
        for s, w in shards(w_own, comm, overlap):
            dx, dh, g = slice_bwd(dx, dy2, w, saved[s], bias)
            part = [dh, g]  # (handed over: the taker empties it, so this frame keeps none)
            del dh, g
            yield s, part

    if defer is None:
        dw_own = grads(input_pass(), x2, dy2, w_own, comm, overlap)
    else:
        parts = list(input_pass())
        defer(lambda: grads(drained(parts), x2, dy2, w_own, comm, overlap))
        dw_own = None
    assert dx is not None  # (D >= 1 slices)
    return dx.view(B, n, h), dw_own


def ring_grads(
    parts: Iterable[Part],
    x2: torch.Tensor,
    dy2: torch.Tensor,
    w_own: torch.Tensor,
    comm: Comm,
    overlap: bool,
) -> torch.Tensor:
    """The ring's weight pass: at step t this rank adds its tokens' part of the slice it held
    then (``parts``' t-th (t, [dh, g]), emptied as taken) to the accumulator arriving for that
    slice and sends it on; after D steps and the last hop its own slice's dW is home."""
    # the accumulator for the slice held now (in flight from rank p-1), the one sent last,
    # and, with overlap, accumulator buffers free for reuse: three take turns (the one being
    # computed, the one arriving, the one leaving), so the steps allocate none
    arriving, sent = None, None
    spare: list[torch.Tensor] = []
    for _, part in parts:
        dh, g = part
        part.clear()  # (dh and g die at the del below, before this step allocates again)
        acc = slice_grad(spare.pop() if spare else torch.empty_like(w_own), dh, g, x2, dy2)
        del dh, g
        if arriving is not None:  # add the accumulator that came for this slice
            arrived = arriving.wait()  # (the exchange that sent `sent` is done too)
            acc += arrived
            if overlap:  # (with overlap the accumulator sent last is kept: sent is set)
                assert sent is not None
                spare += [arrived, sent]
            del arrived
        recv = spare.pop() if spare else torch.empty_like(acc)
        arriving, sent = comm.ring_exchange(acc, recv, async_op=True), acc
        del acc, recv
        if not overlap:
            arriving, sent = Pending.ready(arriving.wait()), None
    assert arriving is not None  # (D >= 1 steps)
    return arriving.wait()


def broadcast_mlp_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    w_own: torch.Tensor,
    saved: list[torch.Tensor],
    comm: Comm,
    overlap: bool,
    bias: bool = False,
    defer: Defer | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dX, this rank's packed dW): the slices are broadcast again; each rank's part of dW_s is
    reduced to owner s while the next slice computes; with ``defer`` (a zero-bubble schedule's
    input pass) the reduces' pass is handed to it, and dW is None."""
    return _backward(owner_shards, reduced_grads, dy, x, w_own, saved, comm, overlap, bias, defer)


def reduced_grads(
    parts: Iterable[Part],
    x2: torch.Tensor,
    dy2: torch.Tensor,
    w_own: torch.Tensor,
    comm: Comm,
    overlap: bool,
) -> torch.Tensor:
    """The broadcast schedule's weight pass: per slice s, this rank's tokens' part of dW_s,
    reduced to owner s while the next computes (at most one in flight); this rank's own dW."""
    dw_own, reduces = None, OneInFlight(comm, wait_each=not overlap)
    for s, part in parts:
        dh, g = part
        part.clear()  # (dh and g die at the del below)
        dw = slice_grad(torch.empty_like(w_own), dh, g, x2, dy2)  # this rank's tokens' part
        del dh, g
        reduces.reduce(dw, dst=s)
        if s == comm.rank:
            dw_own = dw
    reduces.drain()
    assert dw_own is not None  # (one of the slices is this rank's)
    return dw_own


class RingMLP(torch.autograd.Function):
    """res + MLP(x) by the ring schedule: :func:`mlp_forward` over :func:`ring`,
    :func:`ring_mlp_backward`."""

    @staticmethod
    def forward(
        ctx, res, x, w_own, comm: Comm, overlap: bool, grad: bool, recompute: bool = False,
        bias: bool = False, wpass: WeightPass | None = None,
    ):  # fmt: skip
        save = grad and any(ctx.needs_input_grad)  # (needs_input_grad ignores no_grad)
        ctx.comm, ctx.overlap, ctx.bias, ctx.defer = comm, overlap, bias, deferring(wpass, w_own)
        y, saved = mlp_forward(res, x, ring(w_own, comm, overlap), save, recompute, bias)
        if save:
            ctx.save_for_backward(x, w_own, *saved)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w_own, *saved = ctx.saved_tensors
        dx, dw_own = ring_mlp_backward(
            dy, x, w_own, saved, ctx.comm, ctx.overlap, ctx.bias, ctx.defer
        )
        return dy, dx, dw_own, None, None, None, None, None, None


class BroadcastMLP(torch.autograd.Function):
    """res + MLP(x) by the broadcast schedule: :func:`mlp_forward` over
    :func:`tsp_impl.overlap.owner_shards`, :func:`broadcast_mlp_backward`."""

    @staticmethod
    def forward(
        ctx, res, x, w_own, comm: Comm, overlap: bool, grad: bool, recompute: bool = False,
        bias: bool = False, wpass: WeightPass | None = None,
    ):  # fmt: skip
        save = grad and any(ctx.needs_input_grad)  # (needs_input_grad ignores no_grad)
        ctx.comm, ctx.overlap, ctx.bias, ctx.defer = comm, overlap, bias, deferring(wpass, w_own)
        y, saved = mlp_forward(res, x, owner_shards(w_own, comm, overlap), save, recompute, bias)
        if save:
            ctx.save_for_backward(x, w_own, *saved)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w_own, *saved = ctx.saved_tensors
        dx, dw_own = broadcast_mlp_backward(
            dy, x, w_own, saved, ctx.comm, ctx.overlap, ctx.bias, ctx.defer
        )
        return dy, dx, dw_own, None, None, None, None, None, None
