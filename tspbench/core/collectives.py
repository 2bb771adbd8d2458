"""Differentiable counted collectives: the Megatron f/g pair, the sequence all-gather and the
DeepSpeed-Ulysses all-to-all pair (sequence-sharded <-> head-sharded).

Each is an autograd Function over a :class:`Comm`, so gradients flow through communication and
every byte is counted in both directions.
"""

from __future__ import annotations

import torch

from tspbench.core.comm import Comm


class CopyToGroup(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, comm: Comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.all_reduce(g.contiguous()), None


class ReduceFromGroup(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, comm: Comm):
        return comm.all_reduce(x.contiguous())

    @staticmethod
    def backward(ctx, g):
        return g, None


class GatherSequence(torch.autograd.Function):
    """All-gather zigzag shards along ``dim`` into global order; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, comm: Comm, dim: int, to_global, to_gathered):
        ctx.meta = (comm, dim, to_gathered)
        return comm.all_gather(x, dim=dim).index_select(dim, to_global)

    @staticmethod
    def backward(ctx, g):
        comm, dim, to_gathered = ctx.meta
        return (
            comm.reduce_scatter(g.index_select(dim, to_gathered), dim=dim),
            None,
            None,
            None,
            None,
        )


def _blocks_to_out(recv: torch.Tensor, lead: int) -> torch.Tensor:
    """[D, t, *lead, H/D, d] (block j: head group j of this rank's tokens) -> [*lead, H, t, d],
    laid out as [*lead, t, H, d] (so that merging the heads after attention is a view)."""
    D, t, *_, Hl, d = recv.shape
    order = (*range(2, 2 + lead), 1, 0, 2 + lead, 3 + lead)
    return recv.permute(order).reshape(*recv.shape[2 : 2 + lead], t, D * Hl, d).transpose(-3, -2)


def _seq_to_heads(x: torch.Tensor, comm: Comm, to_global: torch.Tensor) -> torch.Tensor:
    """[..., H, S/D, d] of this rank's zigzag tokens -> [..., H/D, S, d], head group ``rank``
    of every token in global order: one all-to-all (head group j to rank j), then the reorder.
    Blocks travel as [t, ..., H/D, d]: one copy on each side."""
    D, lead = comm.size, x.dim() - 3
    order = (lead, lead + 2, *range(lead), lead + 1, lead + 3)
    send = x.unflatten(-3, (D, x.shape[-3] // D)).permute(order)  # [D, t, ..., H/D, d]
    recv = comm.all_to_all(send)  # block j: rank j's tokens of this rank's heads
    return recv.flatten(0, 1).index_select(0, to_global).movedim(0, -2)


def _heads_to_seq(y: torch.Tensor, comm: Comm, to_gathered: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_seq_to_heads`: [..., H/D, S, d] (global order) -> [..., H, S/D, d] of
    this rank's zigzag tokens: the reorder into rank-ordered blocks, then one all-to-all."""
    D, S = comm.size, y.shape[-2]
    send = y.movedim(-2, 0).index_select(0, to_gathered).unflatten(0, (D, S // D))
    return _blocks_to_out(comm.all_to_all(send), y.dim() - 3)


class SeqToHeads(torch.autograd.Function):
    """Sequence-sharded zigzag [..., H, S/D, d] -> head-sharded [..., H/D, S, d] in global
    order (one all-to-all); backward is the inverse."""

    @staticmethod
    def forward(ctx, x, comm: Comm, to_global, to_gathered):
        ctx.meta = (comm, to_gathered)
        return _seq_to_heads(x, comm, to_global)

    @staticmethod
    def backward(ctx, g):
        comm, to_gathered = ctx.meta
        return _heads_to_seq(g, comm, to_gathered), None, None, None


class HeadsToSeq(torch.autograd.Function):
    """Head-sharded [..., H/D, S, d] in global order -> this rank's zigzag tokens
    [..., H, S/D, d] (one all-to-all); backward is the inverse."""

    @staticmethod
    def forward(ctx, y, comm: Comm, to_global, to_gathered):
        ctx.meta = (comm, to_global)
        return _heads_to_seq(y, comm, to_gathered)

    @staticmethod
    def backward(ctx, g):
        comm, to_global = ctx.meta
        return _seq_to_heads(g, comm, to_global), None, None, None


def copy_to(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return CopyToGroup.apply(x, comm) if comm.size > 1 else x


def reduce_from(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return ReduceFromGroup.apply(x, comm) if comm.size > 1 else x
