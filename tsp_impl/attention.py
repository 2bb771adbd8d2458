"""TSP attention: the broadcast schedule (``docs/method.md`` §3).

Rank p holds its zigzag tokens X_p [B, S/D, h] and owns head group p's weights, packed into one
tensor W_p = [Wq_p; Wk_p; Wv_p; Wo_p^T] (rows of width h) so one broadcast moves them all.

Forward, identical loop order on every rank:
    for r in 0..D-1:                          # W_{r+1}'s broadcast is in flight meanwhile
        W_r = broadcast(owner r)
        [Q K_p V_p] = X_p [Wq_r; Wk_r; Wv_r]^T  # one GEMM; RoPE on Q, K at global positions
        for each bucket of KV heads:          # bounds the gathered K/V buffer
            K, V = all_gather(K_p, V_p) along the sequence, in global order
            A = causal attention of the local query chunks over K, V
        Y_p += A Wo_r                         # local accumulation: no all-reduce
Saved per head group: local [Q K_p V_p] (one tensor), A and the log-sum-exp (all S/D tokens
long); the full-sequence K/V is *not* saved by default (``kv_backward = regather``). The
alternative (``save``, ``plan.save_kv``) keeps each bucket's gathered K/V instead: no gather in
backward, for the full-sequence K/V of every head alive per layer (docs/method.md section 3).

Backward, same loop (W_{r+1}'s broadcast in flight, dW_{r-1}'s reduce still draining):
    W_r = broadcast(owner r) again; K, V = all_gather(K_p, V_p) again (per bucket; or saved)
    dA = dY_p Wo_r^T; dWo_r = A^T dY_p
    dQ, dK, dV = attention backward           # dK, dV span the whole sequence
    dK_p, dV_p = reduce_scatter(dK, dV)       # back to the token owners
    dX_p += [dQ dK_p dV_p] [Wq_r; Wk_r; Wv_r]; dW{q,k,v}_r = [dQ dK_p dV_p]^T X_p   # one GEMM each
    reduce(packed dW_r -> owner r)            # async; each weight gradient ends on its owner

Packing, so that a head group costs few kernel launches: Q, K, V are one GEMM into one
[B, S/D, hq + 2 hkv, d] tensor, RoPE rotates its Q and K heads in place in one multiply-and-sum
(``rotate``), K and V travel as one [S/D, 2, B, b, d] tensor (sequence outermost, so the gathered
buffer needs no reshuffle beyond the one index_select into global order), the chunks' dK and dV
are scatter-added into the gathered-order buffer the reduce-scatter takes (two index_add_ calls),
[dQ dK_p dV_p] is one tensor for the dX and dW GEMMs, and the layer's residual input starts the
accumulation of Y (the Function returns residual + attention).

With ``kv_exchange = ring`` (``plan.ring``) each bucket's local K/V pair goes round the ring
instead (:mod:`tspbench.core.ring_attention`): forward, the queries meet one arriving chunk pair
per step, merged by log-sum-exp, nothing of sequence length S allocated; backward, the pair goes
round again with the fp32 dK/dV sums a hop behind, which the last hop brings home (the
reduce-scatter's work). The saved tensors are the same, one log-sum-exp per bucket.

The two loops are plain functions, ``attention_forward`` and ``attention_backward`` (tensors and
the plan in, outputs and what backward needs out), under a thin ``BroadcastAttention``
autograd.Function that keeps the saved tensors on its ctx. Decode's prefill runs the same
forward, its ``keep`` hook filling the KV cache with each head group's local K/V.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from tsp_impl.ops import accumulate
from tsp_impl.overlap import OneInFlight, owner_shards
from tsp_impl.plan import TSPPlan
from tsp_impl.weight_pass import Defer, WeightPass, deferring, drained
from tspbench.core.attention import causal_bwd, causal_fwd
from tspbench.core.config import ModelConfig
from tspbench.core.layers import rms_norm_bwd, rms_norm_fwd
from tspbench.core.ring_attention import ring_backward, ring_forward

Keep = Callable[[int, torch.Tensor, torch.Tensor], None]  # (head group r, its local K, V)
Norms = tuple[torch.Tensor, torch.Tensor] | None  # Qwen3's QK norm weights [d] each, or none
Part = tuple[int, list[torch.Tensor]]  # (head group r, [its dQKV, its A]): its weight pass


def qkv_rows(plan: TSPPlan) -> int:
    """Rows of [Wq_r; Wk_r; Wv_r] in a packed shard (then Wo_r^T, then the biases' rows)."""
    return (plan.hq + 2 * plan.hkv) * plan.cfg.d_head


def bias_rows(cfg: ModelConfig, D: int) -> int:
    """Rows of width h that carry a head group's QKV biases (Qwen2) at the end of its packed
    shard, zero-padded, so that one broadcast moves them with the weights (0 without)."""
    n = (cfg.heads + 2 * cfg.kv_heads) // D * cfg.d_head
    return -(-n // cfg.hidden) if cfg.qkv_bias else 0


def wo_t(w: torch.Tensor, plan: TSPPlan) -> torch.Tensor:
    """Wo_r^T [hq d, h] of a packed shard."""
    rows = qkv_rows(plan)
    return w[rows : rows + plan.hq * plan.cfg.d_head]


def qkv_bias(w: torch.Tensor, plan: TSPPlan) -> torch.Tensor | None:
    """[bq_r; bk_r; bv_r] of a packed shard (a view of its last rows), or None."""
    if not plan.cfg.qkv_bias:
        return None
    rows = qkv_rows(plan)
    return w[rows + plan.hq * plan.cfg.d_head :].flatten()[:rows]


def rotate(t: torch.Tensor, table: torch.Tensor) -> None:
    """RoPE in place on ``t`` [B, L, heads, d] (a view of the packed projection): every pair
    (x_i, x_{i+d/2}) times its 2x2 rotation ``table`` [L, 1, 2, 2, d/2], one broadcast multiply
    and one sum (the arithmetic of x cos + rotate_half(x) sin)."""
    pairs = t.unflatten(-1, (2, -1))
    torch.sum(pairs.unsqueeze(-3) * table, dim=-2, out=pairs)


def project(x: torch.Tensor, w: torch.Tensor, plan: TSPPlan) -> torch.Tensor:
    """Local tokens' [Q | K | V] for one head group: [B, S/D, hq + 2 hkv, d], before RoPE
    (and before the QK norms, where the model has them)."""
    B, n, h = x.shape
    bias, wqkv = qkv_bias(w, plan), w[: qkv_rows(plan)].T
    out = x.view(B * n, h) @ wqkv if bias is None else torch.addmm(bias, x.view(B * n, h), wqkv)
    return out.view(B, n, -1, plan.cfg.d_head)


def qk_split(t: torch.Tensor, plan: TSPPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The Q heads and the K heads of a packed [B, S/D, hq + 2 hkv, d] tensor (views)."""
    return t[:, :, : plan.hq], t[:, :, plan.hq : plan.hq + plan.hkv]


def position(qkv: torch.Tensor, norms: Norms, plan: TSPPlan):
    """RoPE on the projection's Q and K heads: in place without QK norms (returns it); with them
    each head normed into a new tensor first, the projection kept for backward (returns the new
    one and the two norms' 1/rms)."""
    if norms is None:
        rotate(qkv[:, :, : plan.hq + plan.hkv], plan.rot)
        return qkv, ()
    out, eps = torch.empty_like(qkv), plan.cfg.norm_eps
    rstds = []
    for src, dst, w in zip(qk_split(qkv, plan), qk_split(out, plan), norms):
        y, rstd = rms_norm_fwd(src, w, eps)
        dst.copy_(y)
        rstds.append(rstd)
    out[:, :, plan.hq + plan.hkv :] = qkv[:, :, plan.hq + plan.hkv :]  # V as projected
    rotate(out[:, :, : plan.hq + plan.hkv], plan.rot)
    return out, tuple(rstds)


def unnorm_grad(dqkv: torch.Tensor, raw: torch.Tensor, norms, rstds, plan: TSPPlan, dnorms):
    """Through the QK norms' backward in place: dqkv's Q and K heads (grads of the normed heads,
    RoPE already undone) become the projection's; each norm weight's gradient (this head
    group's, over the local tokens) is added to ``dnorms``."""
    for i, (dy, x, w, rstd) in enumerate(
        zip(qk_split(dqkv, plan), qk_split(raw, plan), norms, rstds)
    ):
        dx, dw = rms_norm_bwd(dy, x, w, rstd)
        assert dx is not None  # (need_dx)
        dy.copy_(dx)
        dnorms[i] = dw if dnorms[i] is None else dnorms[i].add_(dw)


def heads(qkv: torch.Tensor, plan: TSPPlan, ks: slice):
    """[B, heads, S/D, d] views of Q (the query heads of KV heads ``ks``), K and V."""
    hq, hkv, g = plan.hq, plan.hkv, plan.hq // plan.hkv
    q = qkv[:, :, ks.start * g : ks.stop * g]
    k = qkv[:, :, hq + ks.start : hq + ks.stop]
    v = qkv[:, :, hq + hkv + ks.start : hq + hkv + ks.stop]
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def gather_kv(k: torch.Tensor, v: torch.Tensor, plan: TSPPlan):
    """All-gather local K/V [B, b, S/D, d] along the sequence: [B, b, S, d] views in global
    order (of one [S, 2, B, b, d] buffer)."""
    packed = [k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)]  # [S/D, B, b, d] views
    kv = plan.comm.all_gather(torch.stack(packed, dim=1), dim=0).index_select(0, plan.to_global)
    return kv[:, 0].permute(1, 2, 0, 3), kv[:, 1].permute(1, 2, 0, 3)


def scatter_kv_grad(dks: list[torch.Tensor], dvs: list[torch.Tensor], plan: TSPPlan):
    """Sum the chunks' dK/dV (each over its keys' prefix of the sequence) into one gathered-order
    [S, 2, B, b, d] buffer and reduce-scatter it back to the token owners: [S/D, 2, B, b, d].
    The rows of ``plan.dkv_index`` come in two sources, each at most one head group's K/V over
    the sequence: the chunks' dK, dV but the last chunk's dV (concatenated), then that dV.
    Consumes the lists (their tensors are freed once concatenated)."""
    parts = [x for dk, dv in zip(dks[:-1], dvs[:-1]) for x in (dk, dv)] + [dks[-1]]
    src, last = torch.cat(parts, dim=2), dvs[-1]  # [B, b, rows, d]
    dks.clear()
    dvs.clear()
    del parts
    B, b, _, d = src.shape
    full = src.new_zeros((plan.seq_len, 2, B, b, d))
    rows = full.view(-1, B, b, d)
    n = src.shape[2]
    rows.index_add_(0, plan.dkv_index[:n], src.permute(2, 0, 1, 3))
    del src
    rows.index_add_(0, plan.dkv_index[n:], last.permute(2, 0, 1, 3))
    del last
    return plan.comm.reduce_scatter(full, dim=0)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: TSPPlan):
    """Zigzag causal attention of the local queries [B, b', S/D, d] over the gathered K/V:
    ([B, S/D, b', d] output, the chunks' log-sum-exps)."""
    outs, lses = [], []
    for lo, hi, n in plan.chunks:
        o, lse = causal_fwd(q[:, :, lo:hi], k[:, :, :n], v[:, :, :n])
        outs.append(o.transpose(1, 2))
        lses.append(lse)
    return torch.cat(outs, dim=1), lses


def attention_forward(
    res: torch.Tensor | None,
    x: torch.Tensor,
    w_own: torch.Tensor,
    plan: TSPPlan,
    save: bool,
    keep: Keep | None = None,
    norms: Norms = None,
) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """The forward loop over head groups: (res + attention(x) [B, S/D, h] (attention(x) with
    ``res`` None), what backward needs per head group (empty unless ``save``), how many
    log-sum-exps each head group saves). ``keep(r, K_p, V_p)``, if given, sees head group r's
    local K/V ([B, hkv, S/D, d] views, RoPE applied) before they are gathered: decode's prefill
    fills its cache with them. ``norms``: the QK norms' weights (Qwen3); backward then gets the
    projection before them and recomputes them."""
    B, n, h = x.shape
    y, lses = None, list[torch.Tensor]()
    saved: list[torch.Tensor] = []
    for r, w in owner_shards(w_own, plan.comm, plan.overlap):
        raw = project(x, w, plan)
        qkv, _ = position(raw, norms, plan)
        if not save:
            del raw  # (with QK norms: the projection before them is not needed again)
        if keep is not None:
            keep(r, *heads(qkv, plan, slice(0, plan.hkv))[1:])
        parts, lses, kvs = [], [], []
        for _, ks in plan.buckets():
            q, k, v = heads(qkv, plan, ks)
            if plan.ring:  # [B, b', S/D, d] output laid out as the kernel's: [B, S/D, b', d]
                o, lse_b = ring_forward(q, torch.stack([k, v]), plan.comm, plan.overlap)
                parts.append(o.transpose(1, 2))
                lses.append(lse_b)
                del o
                continue
            K, V = gather_kv(k, v, plan)
            a, lse = attend(q, K, V, plan)
            parts.append(a)
            lses += lse
            if save and plan.save_kv:
                kvs += [K, V]  # (views of one gathered buffer)
            del K, V
        a = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=2)
        del parts  # (the ring's output, where the kernel's layout made ``a`` a copy)
        # (``res`` None: decode's prefill, no residual)
        y = accumulate(
            y, a.view(B * n, -1), wo_t(w, plan), None if res is None else res.view(B * n, h)
        )
        if save:
            saved += [raw, a, *lses, *kvs]  # (raw is qkv without QK norms)
            del raw
        del qkv, q, k, v, a, kvs  # (not alive while the next head group's are computed)
    assert y is not None  # (D >= 1 head groups)
    return y.view(B, n, h), saved, len(lses)


def attention_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    w_own: torch.Tensor,
    saved: list[torch.Tensor],
    n_lse: int,
    plan: TSPPlan,
    norms: Norms = None,
    defer: Defer | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor | None]]:
    """The backward loop over head groups, from :func:`attention_forward`'s ``saved`` (and
    ``n_lse``): (dX [B, S/D, h], this rank's packed dW, the QK norms' gradients over the local
    tokens). Each head group's dW is reduced to its owner while the next group computes; with
    ``defer`` (a zero-bubble schedule's input pass: tsp_impl/weight_pass.py) that weight pass is
    handed to it instead, over the kept dQKV of every group, and dW is None."""
    B, n, h = x.shape
    kept = 2 * len(plan.buckets()) if plan.save_kv else 0  # saved K, V of each bucket
    per, n_chunks, rows = 2 + n_lse + kept, len(plan.chunks), qkv_rows(plan)
    dx: torch.Tensor | None = None
    dnorms: list[torch.Tensor | None] = [None, None]
    x2, dy2 = x.view(B * n, h), dy.reshape(B * n, h)

    def input_pass() -> Iterator[Part]:
        """(r, [head group r's dQKV [B S/D, rows], its A]) per group, dX accumulated."""
        nonlocal dx
        for r, w in owner_shards(w_own, plan.comm, plan.overlap):
            raw, a, *rest = saved[r * per : (r + 1) * per]
            qkv, rstds = position(raw, norms, plan) if norms is not None else (raw, ())
            lses, kvs = rest[:n_lse], rest[n_lse:]
            da = (dy2 @ wo_t(w, plan).T).view(a.shape)
            dqs, dks, dvs = [], [], []
            for i, (qs, ks) in enumerate(plan.buckets()):
                q, k, v = heads(qkv, plan, ks)
                if plan.ring:  # dK/dV come home round the ring: its chunks' [2, B, b, S/D, d]
                    dq_b, dkv = ring_backward(
                        da[:, :, qs].transpose(1, 2), q, torch.stack([k, v]),
                        a[:, :, qs].transpose(1, 2), lses[i], plan.comm, plan.overlap,
                    )  # fmt: skip
                    dqs.append(dq_b.transpose(1, 2))
                    dks.append(dkv[0].transpose(1, 2))
                    dvs.append(dkv[1].transpose(1, 2))
                    del dq_b, dkv
                    continue
                K, V = kvs[2 * i : 2 * i + 2] if kvs else gather_kv(k, v, plan)
                lse = lses[i * n_chunks : (i + 1) * n_chunks]
                dq, dk, dv = [], [], []
                for (lo, hi, m), l_c in zip(plan.chunks, lse):
                    g = causal_bwd(
                        da[:, lo:hi, qs].transpose(1, 2), q[:, :, lo:hi], K[:, :, :m],
                        V[:, :, :m], a[:, lo:hi, qs].transpose(1, 2), l_c,
                    )  # fmt: skip
                    dq.append(g[0].transpose(1, 2))
                    dk.append(g[1])
                    dv.append(g[2])
                del K, V, g
                dqs.append(torch.cat(dq, dim=1))
                dkv = scatter_kv_grad(dk, dv, plan).permute(2, 0, 1, 3, 4)  # [B, S/D, 2, b, d]
                dks.append(dkv[:, :, 0])
                dvs.append(dkv[:, :, 1])
                del dq, dk, dv, dkv
            dqkv = torch.cat(dqs + dks + dvs, dim=2)  # [B, S/D, hq + 2 hkv, d]
            del dqs, dks, dvs, qkv, q, k, v, da
            rotate(dqkv[:, :, : plan.hq + plan.hkv], plan.rot_inv)
            if norms is not None:
                unnorm_grad(dqkv, raw, norms, rstds, plan, dnorms)
            del raw
            dqkv = dqkv.view(B * n, rows)
            dx = accumulate(dx, dqkv, w[:rows])
            part = [dqkv, a]  # (handed over: the taker empties it, so this frame keeps none)
            del dqkv, a
            yield r, part

    if defer is None:  # the weight pass behind the input pass, group by group
        dw_own = head_group_grads(input_pass(), x2, dy2, w_own, plan)
    else:
        parts = list(input_pass())
        defer(lambda: head_group_grads(drained(parts), x2, dy2, w_own, plan))
        dw_own = None
    assert dx is not None  # (D >= 1 head groups)
    return dx.view(B, n, h), dw_own, dnorms


def head_group_grads(
    parts: Iterable[Part], x2: torch.Tensor, dy2: torch.Tensor, w_own: torch.Tensor, plan: TSPPlan
) -> torch.Tensor:
    """The weight pass: per head group r, this rank's tokens' packed dW_r = [dQKV^T X;
    (A^T dY)^T] (and the QKV biases' column sums), reduced to owner r while the next group
    computes (at most one in flight); this rank's own dW."""
    dw_own, reduces = None, OneInFlight(plan.comm)
    rows = qkv_rows(plan)
    for r, part in parts:
        dqkv, a = part
        part.clear()  # (dQKV dies at the del below, before the next group's are computed)
        dw = torch.empty_like(w_own)  # packed like W_r: written by its two GEMMs
        torch.mm(dqkv.T, x2, out=dw[:rows])
        torch.mm(a.view(x2.shape[0], -1).T, dy2, out=wo_t(dw, plan))  # dWo_r^T
        if plan.cfg.qkv_bias:  # the biases' rows: their gradient, then zeros
            dw[rows + plan.hq * plan.cfg.d_head :].zero_()
            torch.sum(dqkv, dim=0, out=qkv_bias(dw, plan))
        del dqkv, a  # (not alive while the next head group's are computed)
        reduces.reduce(dw, dst=r)
        if r == plan.rank:
            dw_own = dw
    reduces.drain()
    assert dw_own is not None  # (one head group is this rank's)
    return dw_own


class BroadcastAttention(torch.autograd.Function):
    """res + attention(x) by the broadcast schedule: :func:`attention_forward` and
    :func:`attention_backward`, the tensors they pass between them saved on ``ctx``."""

    @staticmethod
    def forward(
        ctx, res, x: torch.Tensor, w_own: torch.Tensor, plan: TSPPlan, grad: bool,
        wpass: WeightPass | None = None, qn=None, kn=None,
    ):  # fmt: skip
        """res + attention(x): the residual ``res`` starts the accumulation of Y (``qn``,
        ``kn``: the QK norms' weights, where the model has them; ``wpass``: a zero-bubble
        schedule's, which takes the weight pass)."""
        save = grad and any(ctx.needs_input_grad)  # (needs_input_grad ignores no_grad)
        norms = None if qn is None else (qn, kn)
        y, saved, ctx.n_lse = attention_forward(res, x, w_own, plan, save, norms=norms)
        ctx.plan, ctx.normed, ctx.defer = plan, norms is not None, deferring(wpass, w_own)
        if save:
            ctx.save_for_backward(x, w_own, *(norms or ()), *saved)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w_own, *saved = ctx.saved_tensors
        norms = (saved.pop(0), saved.pop(0)) if ctx.normed else None
        dx, dw_own, (dqn, dkn) = attention_backward(
            dy, x, w_own, saved, ctx.n_lse, ctx.plan, norms, ctx.defer
        )
        return dy, dx, dw_own, None, None, None, dqn, dkn
