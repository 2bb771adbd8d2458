"""Zigzag ring attention: context parallelism's point-to-point K/V exchange (Megatron-Core's
``cp_comm_type="p2p"``, ring-flash-attention's ``zigzag_ring_flash_attn``).

Rank r holds zigzag chunks r and 2D-1-r of Q, K and V (c tokens each). Forward: D steps; at
step s the rank holds the K/V of rank src = r - s (mod D), sends it on to r + 1 while it computes
that block, and merges the block's partial output by its log-sum-exp. Causality picks the block:
s = 0, the local causal block (chunk r sees chunk r causally, chunk 2D-1-r sees chunk r fully
and itself causally: a square causal block over the local tokens); src < r, every local query
over src's first chunk (chunk src < r, while chunk 2D-1-src > 2D-1-r is unseen by both);
src > r, the second local chunk over both of src's chunks (the first, chunk r < src, sees
neither). Every block but the first is unmasked, and each rank computes as many pairs as with
the all-gathered K/V. Backward: K/V travel the ring again, with the dK/dV accumulated so far
beside them, so after D hops each rank holds its own chunks' full dK/dV.

At most two K/V chunks are alive at a time (the one in use and the one in flight), and the
layer keeps only its own K/V for backward, where the all-gather keeps the whole sequence's.
"""

from __future__ import annotations

import torch

from tspbench.core.attention import block_bwd, block_fwd
from tspbench.core.comm import Comm, Pending


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lse_b: torch.Tensor) -> None:
    """In place: fold one block's (o, lse_b) into the running fp32 (out, lse)."""
    new = torch.logaddexp(lse, lse_b)
    out.mul_((lse - new).exp()[..., None]).add_(o.float() * (lse_b - new).exp()[..., None])
    lse.copy_(new)


def _shift(t: torch.Tensor, comm: Comm, overlap: bool) -> Pending:
    """Start sending ``t`` to the next rank; the pending result is the previous rank's. With
    ``overlap`` off the hop is waited for at once (what ``tspbench overlap`` compares with)."""
    pending = comm.ring_exchange(t, torch.empty_like(t), async_op=True)
    return pending if overlap else Pending.ready(pending.wait())


def _forward_block(
    q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, early: bool
) -> None:
    """Fold one arrived chunk pair's block into (out, lse): ``early`` (a previous rank's
    chunks) every query over their first chunk; else the second local chunk over both. The
    block's output dies here, before the next one is computed."""
    c = q.shape[-2] // 2
    if early:
        _merge(out, lse, *block_fwd(q, kv[0, :, :, :c], kv[1, :, :, :c], causal=False))
    else:
        _merge(out[:, :, c:], lse[:, :, c:], *block_fwd(q[:, :, c:], kv[0], kv[1], causal=False))


def ring_forward(
    q: torch.Tensor, kv: torch.Tensor, comm: Comm, overlap: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Hq, 2c, d], lse [B, Hq, 2c] fp32) of this rank's zigzag queries over the
    whole sequence, given its own packed ``kv`` [2, B, Hkv, 2c, d]; each arriving chunk is
    sent on before its block is computed, so the transfer runs behind the compute."""
    D, r = comm.size, comm.rank  # D >= 2 (cp_tables runs D = 1 as plain attention)
    pending = _shift(kv, comm, overlap)
    o, lse_b = block_fwd(q, kv[0], kv[1], causal=True)
    out, lse = o.float(), lse_b.clone()
    del o, lse_b
    for s in range(1, D):
        kv = pending.wait()
        if s + 1 < D:
            pending = _shift(kv, comm, overlap)
        _forward_block(q, kv, out, lse, early=(r - s) % D < r)
    return out.to(q.dtype), lse


def _backward_block(
    dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dq: torch.Tensor, sent: Pending, early: bool,
) -> torch.Tensor:  # fmt: skip
    """One arrived chunk pair's block gradients (as :func:`_forward_block` picks the block),
    added to ``dq`` and to the chunks' dK/dV sum, which arrives (``sent``) while they are
    computed; returns that sum. The block's gradients die here."""
    c = q.shape[-2] // 2
    if early:
        dq_b, dk, dv = block_bwd(dout, q, kv[0, :, :, :c], kv[1, :, :, :c], out, lse, False)
        dkv = sent.wait()
        dq.add_(dq_b)
        dkv[0, :, :, :c] += dk
        dkv[1, :, :, :c] += dv
        return dkv
    h = slice(c, None)  # the second local chunk
    dq_b, dk, dv = block_bwd(
        dout[:, :, h], q[:, :, h], kv[0], kv[1], out[:, :, h], lse[:, :, h].contiguous(), False
    )
    dkv = sent.wait()
    dq[:, :, h] += dq_b
    dkv[0] += dk
    dkv[1] += dv
    return dkv


def ring_backward(
    dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    comm: Comm, overlap: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dkv) for :func:`ring_forward`: the K/V go round again, and each block's dK/dV is
    added to the accumulator of that chunk, which travels one hop behind (fp32, as
    ring-flash-attention's); one last hop brings every rank its own chunks' sum."""
    D, r = comm.size, comm.rank
    pending = _shift(kv, comm, overlap)
    dq, dk, dv = block_bwd(dout, q, kv[0], kv[1], out, lse, causal=True)
    dq, dkv = dq.float(), torch.stack([dk, dv]).float()
    del dk, dv
    for s in range(1, D):
        kv = pending.wait()
        if s + 1 < D:
            pending = _shift(kv, comm, overlap)
        sent = _shift(dkv, comm, overlap)  # the sum so far goes on while this block computes
        dkv = _backward_block(dout, q, kv, out, lse, dq, sent, early=(r - s) % D < r)
    dkv = _shift(dkv, comm, overlap).wait()  # the last hop: nothing left to hide it behind
    return dq.to(q.dtype), dkv.to(kv.dtype)


class RingAttention(torch.autograd.Function):
    """Differentiable :func:`ring_forward`: keeps this rank's packed K/V (not the sequence's)."""

    @staticmethod
    def forward(ctx, q, k, v, comm: Comm, overlap: bool):
        kv = torch.stack([k, v])
        out, lse = ring_forward(q, kv, comm, overlap)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.comm, ctx.overlap = comm, overlap
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        dq, dkv = ring_backward(dout.contiguous(), q, kv, out, lse, ctx.comm, ctx.overlap)
        return dq, dkv[0], dkv[1], None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, overlap: bool = True
) -> torch.Tensor:
    """Zigzag causal attention of this rank's tokens over the sequence held by ``comm``."""
    return RingAttention.apply(q, k, v, comm, overlap)
