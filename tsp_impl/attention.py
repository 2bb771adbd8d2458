"""TSP attention: the broadcast schedule (``docs/method.md`` §3).

Rank p holds its zigzag tokens X_p [B, S/D, h] and owns head group p's weights, packed into one
tensor W_p = [Wq_p; Wk_p; Wv_p; Wo_p^T] (rows of width h) so one broadcast moves them all.

Forward, identical loop order on every rank:
    for r in 0..D-1:                          # W_{r+1}'s broadcast is in flight meanwhile
        W_r = broadcast(owner r)
        Q, K_p, V_p = X_p W_r                 # local tokens, head group r, RoPE at global positions
        for each bucket of KV heads:          # bounds the gathered K/V buffer
            K, V = all_gather(K_p, V_p) along the sequence, in global order
            A = causal attention of the local query chunks over K, V
        Y_p += A Wo_r                         # local accumulation: no all-reduce
Saved per head group: local Q, K_p, V_p, A and the log-sum-exp (all S/D tokens long); the
full-sequence K/V is *not* saved.

Backward, same loop (W_{r+1}'s broadcast in flight, dW_{r-1}'s reduce still draining):
    W_r = broadcast(owner r) again; K, V = all_gather(K_p, V_p) again (per bucket)
    dA = dY_p Wo_r^T; dWo_r = A^T dY_p
    dQ, dK, dV = attention backward           # dK, dV span the whole sequence
    dK_p, dV_p = reduce_scatter(dK, dV)       # back to the token owners
    dX_p += dQ Wq_r + dK_p Wk_r + dV_p Wv_r; dW{q,k,v}_r = d{Q,K_p,V_p}^T X_p
    reduce(packed dW_r -> owner r)            # async; each weight gradient ends on its owner
"""

from __future__ import annotations

import torch

from tsp_impl.overlap import owner_shards
from tsp_impl.plan import TSPPlan
from tspbench.core.attention import zigzag_bwd, zigzag_fwd
from tspbench.core.layers import apply_rope


def split_shard(w: torch.Tensor, plan: TSPPlan):
    """(Wq_r, Wk_r, Wv_r, Wo_r^T) views of a packed head-group shard."""
    d = plan.cfg.head_dim
    return w.split([plan.hq * d, plan.hkv * d, plan.hkv * d, plan.hq * d], dim=0)


def project(x: torch.Tensor, w: torch.Tensor, plan: TSPPlan):
    """Local tokens' Q, K, V for one head group, as [B, heads, S/D, d], RoPE applied."""
    wq, wk, wv, _ = split_shard(w, plan)
    B, S_loc, _ = x.shape
    d = plan.cfg.head_dim

    def heads(t: torch.Tensor, n: int) -> torch.Tensor:
        return t.view(B, S_loc, n, d).transpose(1, 2)

    q = apply_rope(heads(x @ wq.T, plan.hq), plan.cos, plan.sin)
    k = apply_rope(heads(x @ wk.T, plan.hkv), plan.cos, plan.sin)
    return q, k, heads(x @ wv.T, plan.hkv)


def gather_kv(k: torch.Tensor, v: torch.Tensor, plan: TSPPlan):
    """All-gather local K/V along the sequence and put them in global order."""
    kv = plan.comm.all_gather(torch.stack([k, v]), dim=3)
    kv = kv.index_select(3, plan.to_global)
    return kv[0], kv[1]


def scatter_kv_grad(dk: torch.Tensor, dv: torch.Tensor, plan: TSPPlan):
    """Reduce-scatter full-sequence dK/dV back to the ranks that own those tokens."""
    dkv = torch.stack([dk, dv]).index_select(3, plan.to_gathered)
    dkv = plan.comm.reduce_scatter(dkv, dim=3)
    return dkv[0], dkv[1]


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    """[B, heads, S, d] -> [B, S, heads*d]."""
    return t.transpose(1, 2).flatten(2)


class BroadcastAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w_own: torch.Tensor, plan: TSPPlan, grad: bool):  # type: ignore[override]
        save = grad and any(ctx.needs_input_grad)  # (needs_input_grad ignores no_grad)
        y = torch.zeros_like(x)
        saved: list[torch.Tensor] = []
        for _, w in owner_shards(w_own, plan.comm, plan.overlap):
            q, k, v = project(x, w, plan)
            parts, lses = [], []
            for qs, ks in plan.buckets():
                K, V = gather_kv(k[:, ks], v[:, ks], plan)
                a, lse = zigzag_fwd(q[:, qs], K, V, plan.rank, plan.D)
                parts.append(a)
                lses += lse
            a = torch.cat(parts, dim=1)
            y += merge_heads(a) @ split_shard(w, plan)[3]
            if save:
                saved += [q, k, v, a, *lses]
        ctx.plan = plan
        ctx.n_lse = len(lses)
        if save:
            ctx.save_for_backward(x, w_own, *saved)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        plan: TSPPlan = ctx.plan
        x, w_own, *saved = ctx.saved_tensors
        per, n_chunks = 4 + ctx.n_lse, ctx.n_lse // len(plan.buckets())
        dx = torch.zeros_like(x)
        dw_own, reducing = None, None
        dy2, x2 = dy.flatten(0, 1), x.flatten(0, 1)
        for r, w in owner_shards(w_own, plan.comm, plan.overlap):
            q, k, v, a, *lses = saved[r * per : (r + 1) * per]
            wq, wk, wv, wo_t = split_shard(w, plan)
            a_flat = merge_heads(a)
            da = (dy @ wo_t.T).view(a_flat.shape).unflatten(2, (plan.hq, -1)).transpose(1, 2)
            dwo_t = a_flat.flatten(0, 1).T @ dy2
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            for i, (qs, ks) in enumerate(plan.buckets()):
                K, V = gather_kv(k[:, ks], v[:, ks], plan)
                lse = lses[i * n_chunks : (i + 1) * n_chunks]
                dq[:, qs], dK, dV = zigzag_bwd(
                    da[:, qs].contiguous(), q[:, qs], K, V, a[:, qs], lse, plan.rank, plan.D
                )
                dk[:, ks], dv[:, ks] = scatter_kv_grad(dK, dV, plan)
            dq = merge_heads(apply_rope(dq, plan.cos, -plan.sin))
            dk = merge_heads(apply_rope(dk, plan.cos, -plan.sin))
            dv = merge_heads(dv)
            dx += dq @ wq + dk @ wk + dv @ wv
            dw = torch.cat(
                [dq.flatten(0, 1).T @ x2, dk.flatten(0, 1).T @ x2, dv.flatten(0, 1).T @ x2, dwo_t]
            )
            if reducing is not None:  # at most one gradient reduce in flight
                reducing.wait()
            reducing = plan.comm.reduce(dw, dst=r, async_op=True)
            if r == plan.rank:
                dw_own = dw
        reducing.wait()
        return dx, dw_own, None, None
