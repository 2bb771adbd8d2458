"""Megatron vocab-parallel embedding and cross-entropy over a group that shares activations.

Rank r of the group owns vocabulary rows [r*V/T, (r+1)*V/T) of the embedding and the LM head.
Embedding: masked local lookup, then an all-reduce. Loss: local logits [.., V/T]; the global max,
sum of exponentials and target logit are all-reduced ([B, S] each), so logits never move.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tspbench.core.collectives import copy_to, reduce_from
from tspbench.core.comm import Comm


def embedding(tokens: torch.Tensor, weight: torch.Tensor, comm: Comm) -> torch.Tensor:
    n = weight.shape[0]
    lo = comm.rank * n
    hit = (tokens >= lo) & (tokens < lo + n)
    x = F.embedding((tokens - lo).clamp(0, n - 1), weight) * hit[..., None].to(weight.dtype)
    return reduce_from(x, comm)


class _ParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, comm: Comm):
        n = logits.shape[-1]
        lo = comm.rank * n
        m = logits.amax(-1)
        if comm.size > 1:
            comm.all_reduce(m, op=dist.ReduceOp.MAX)
        e = (logits - m[..., None]).exp()
        s = e.sum(-1)
        hit = (labels >= lo) & (labels < lo + n)
        idx = (labels - lo).clamp(0, n - 1)
        tgt = torch.where(hit, logits.gather(-1, idx[..., None])[..., 0], 0.0)
        if comm.size > 1:
            comm.all_reduce(s)
            comm.all_reduce(tgt)
        ctx.save_for_backward(e, s, hit, idx)
        return s.log() + m - tgt

    @staticmethod
    def backward(ctx, g):
        e, s, hit, idx = ctx.saved_tensors
        p = e / s[..., None]
        p.scatter_add_(-1, idx[..., None], -hit[..., None].to(p.dtype))
        return p * g[..., None], None, None


def cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, comm: Comm
) -> torch.Tensor:
    """Sum over tokens of cross-entropy with a vocab-parallel LM head (activations shared)."""
    logits = (copy_to(hidden, comm) @ weight.T).float()
    return _ParallelCE.apply(logits, labels, comm).sum()
