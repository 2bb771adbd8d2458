"""TSP's mixture of experts: the experts on the same D ranks as everything else.

Rank p owns experts p E/D .. (p+1) E/D - 1, packed as one tensor of E/D blocks
[W1_e; W3_e; W2_e^T] ([E/D x 3 f_e, h]), and its local tokens (TSP's zigzag chunks). The router
is replicated (E x h, gradients summed over the group after backward, as the norms'). Each rank
routes its own tokens (tspbench/core/moe.py: softmax, top-k, dropless). Two schedules bring the
tokens and the experts together, each equal to the reference forward and backward:

- ``all_to_all`` (expert parallel, as Megatron-Core's and DeepSpeed's all-to-all dispatcher):
  the per-expert counts are exchanged, then each token row goes to its experts' owner (dispatch,
  one uneven all-to-all), the owner applies its experts, and the rows come back (combine); only
  activations move, k t h per rank and direction, and backward moves them again in reverse.
  Autograd runs through the two exchanges (tspbench/core/expert_parallel.py, shared with
  FSDP+CP's experts).
- ``ring`` / ``broadcast`` (weights move, TSP's own way): each owner's packed experts travel to
  every rank as the dense MLP's slices do (tsp_impl/mlp.py: a ring of neighbours, or broadcast
  from the owner), and each rank applies them to its own tokens routed there; backward moves
  them again while the gradient of each block goes home (an accumulator one hop behind it, or a
  reduce to the owner). Only weights move, 3 h f_e E/D per rank and step.

Which moves less: the tokens' k t h x 2 directions, or the experts' 3 h f_e E (D-1)/D.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from tsp_impl.mlp import ring, slice_bwd, slice_grad
from tsp_impl.overlap import OneInFlight, owner_shards
from tspbench.core.comm import Comm, Pending
from tspbench.core.expert_parallel import dispatch_combine
from tspbench.core.moe import expert_ffn, rows_of

SCHEDULES = ("all_to_all", "ring", "broadcast")


def expert(w: torch.Tensor, j: int, fe: int) -> torch.Tensor:
    """Block j [3 f_e, h] of a packed set of experts."""
    return w[j * 3 * fe : (j + 1) * 3 * fe]


# -- expert parallel: tokens move ------------------------------------------------------------------
def all_to_all_experts(
    m: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, w_own: torch.Tensor, comm: Comm,
    experts: int, fe: int,
) -> torch.Tensor:  # fmt: skip
    """The routed experts' sum with the rows dispatched to the packed experts' owners and
    combined back (tspbench/core/expert_parallel.py)."""

    def apply(j: int, x: torch.Tensor) -> torch.Tensor:
        w = expert(w_own, j, fe)
        return expert_ffn(x, w[:fe], w[fe : 2 * fe], w[2 * fe :].T)

    return dispatch_combine(m, weights, idx, comm, experts, apply)


# -- weights move ----------------------------------------------------------------------------------
def _owner(schedule: str, t: int, comm: Comm) -> int:
    """Whose experts a rank holds at step t: the ring brings rank p-t's, the broadcast rank t's."""
    return (comm.rank - t) % comm.size if schedule == "ring" else t


def _shards(schedule: str, w_own: torch.Tensor, comm: Comm, overlap: bool) -> Iterator:
    return ring(w_own, comm, overlap) if schedule == "ring" else owner_shards(w_own, comm, overlap)


def moving_forward(
    m: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, w_own: torch.Tensor, comm: Comm,
    overlap: bool, schedule: str, experts: int, fe: int, save: bool,
) -> tuple[torch.Tensor, list[torch.Tensor]]:  # fmt: skip
    """(the routed experts' sum, what backward needs: per held block and expert, h13 and the
    unweighted output) with the experts brought to the tokens."""
    per = experts // comm.size
    y, saved = torch.zeros_like(m), []
    for t, w in _shards(schedule, w_own, comm, overlap):
        first = _owner(schedule, t, comm) * per
        for j in range(per):
            tok, slot = rows_of(idx, first + j, experts)
            we = expert(w, j, fe)
            h13 = m[tok] @ we[: 2 * fe].T
            out = (F.silu(h13[:, :fe]) * h13[:, fe:]) @ we[2 * fe :]
            y.index_add_(0, tok, out * weights[tok, slot, None])
            if save:
                saved += [h13, out]
    return y, saved


def _expert_grads(
    dm: torch.Tensor, dweights: torch.Tensor, acc: torch.Tensor, dy: torch.Tensor,
    m: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
    saved: list[torch.Tensor], first: int, per: int, experts: int, fe: int, base: int,
) -> None:  # fmt: skip
    """Add one held block's part to dm and dweights and write its experts' packed gradient
    from this rank's tokens into ``acc``; ``base``: the block's first entry in ``saved``."""
    for j in range(per):
        tok, slot = rows_of(idx, first + j, experts)
        h13, out = saved[base + 2 * j], saved[base + 2 * j + 1]
        dy_e = dy[tok]
        dweights[tok, slot] = (dy_e * out).sum(-1)
        dys = dy_e * weights[tok, slot, None]  # the weight scales the expert's output
        dx, dh, g = slice_bwd(None, dys, expert(w, j, fe), h13)
        dm.index_add_(0, tok, dx)
        slice_grad(expert(acc, j, fe), dh, g, m[tok], dys)


def ring_backward(
    dy: torch.Tensor, m: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
    w_own: torch.Tensor, saved: list[torch.Tensor], comm: Comm, overlap: bool, experts: int,
    fe: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dm, dweights, this rank's packed expert gradient): the blocks circulate again, each
    one's gradient accumulator one hop behind it (tsp_impl/mlp.py's ring)."""
    per = experts // comm.size
    dm, dweights = torch.zeros_like(m), torch.zeros_like(weights)
    arriving: Pending | None = None
    sent: list[torch.Tensor] = []  # the accumulator in flight: live until its exchange is
    # done, on every backend (gloo's and NCCL's works hold it; the fake group's does not)
    for t, w in ring(w_own, comm, overlap):
        acc = torch.empty_like(w_own)
        first = _owner("ring", t, comm) * per
        _expert_grads(
            dm, dweights, acc, dy, m, weights, idx, w, saved, first, per, experts, fe, 2 * per * t
        )
        if arriving is not None:
            acc += arriving.wait()  # (the exchange that sent `sent` is done too)
        arriving = comm.ring_exchange(acc, torch.empty_like(acc), async_op=True)
        sent[:] = [acc]
        del acc
        if not overlap:
            arriving = Pending.ready(arriving.wait())
            sent.clear()
    assert arriving is not None  # (D >= 1 steps)
    return dm, dweights, arriving.wait()


def broadcast_backward(
    dy: torch.Tensor, m: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
    w_own: torch.Tensor, saved: list[torch.Tensor], comm: Comm, overlap: bool, experts: int,
    fe: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dm, dweights, this rank's packed expert gradient): the blocks are broadcast again and
    each rank's part of a block's gradient is reduced to its owner."""
    per = experts // comm.size
    dm, dweights = torch.zeros_like(m), torch.zeros_like(weights)
    reduces, own = OneInFlight(comm, wait_each=not overlap), None
    for s, w in owner_shards(w_own, comm, overlap):
        acc = torch.empty_like(w_own)
        _expert_grads(
            dm, dweights, acc, dy, m, weights, idx, w, saved, s * per, per, experts, fe,
            2 * per * s,
        )  # fmt: skip
        reduces.reduce(acc, dst=s)
        if s == comm.rank:
            own = acc
    reduces.drain()
    assert own is not None
    return dm, dweights, own


class MovingExperts(torch.autograd.Function):
    """The routed experts' sum with the experts brought to the tokens (ring or broadcast):
    :func:`moving_forward`, then :func:`ring_backward` or :func:`broadcast_backward`."""

    @staticmethod
    def forward(ctx, m, weights, idx, w_own, comm, overlap, schedule, experts, fe, grad):
        save = grad and any(ctx.needs_input_grad)
        ctx.comm, ctx.overlap, ctx.schedule, ctx.experts, ctx.fe = (
            comm, overlap, schedule, experts, fe
        )  # fmt: skip
        args = (m, weights, idx, w_own, comm, overlap, schedule, experts, fe, save)
        y, saved = moving_forward(*args)
        if save:
            ctx.save_for_backward(m, weights, idx, w_own, *saved)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        m, weights, idx, w_own, *saved = ctx.saved_tensors
        bwd = ring_backward if ctx.schedule == "ring" else broadcast_backward
        dm, dweights, dw = bwd(
            dy.contiguous(), m, weights, idx, w_own, saved, ctx.comm, ctx.overlap, ctx.experts,
            ctx.fe,
        )  # fmt: skip
        return dm, dweights, None, dw, None, None, None, None, None, None


def tsp_experts(
    m: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, w_own: torch.Tensor, comm: Comm,
    overlap: bool, schedule: str, experts: int, fe: int,
) -> torch.Tensor:  # fmt: skip
    """The routed experts' sum on this rank's tokens m [t, h] by ``schedule``."""
    if schedule == "all_to_all":
        return all_to_all_experts(m, weights, idx, w_own, comm, experts, fe)
    grad = torch.is_grad_enabled()
    return MovingExperts.apply(m, weights, idx, w_own, comm, overlap, schedule, experts, fe, grad)
