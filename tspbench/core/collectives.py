"""Differentiable counted collectives: the Megatron f/g pair and the sequence all-gather.

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


def copy_to(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return CopyToGroup.apply(x, comm) if comm.size > 1 else x


def reduce_from(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return ReduceFromGroup.apply(x, comm) if comm.size > 1 else x
