"""TSP embedding and LM head/loss over vocabulary shards (``docs/method.md`` §5).

Rank r owns rows [r*V/D, (r+1)*V/D) of the embedding and of the LM head. Both are driven by the
same broadcast schedule as attention, so no activation ever moves:
- Embedding: each owner broadcasts its rows; every rank looks up the local tokens that fall in
  them. Backward, owner by owner: each rank adds its tokens' gradients for that owner's rows
  into a [V/D, h] buffer and reduces it to the owner (one reduce in flight while the next
  buffer fills), so no rank ever holds a [V, h] gradient. Same bytes as one reduce-scatter of
  [V, h]: D reduces of [V/D, h], (D-1)/D of it each on average.
- Loss: each owner broadcasts its head rows; every rank computes its local tokens' logits for that
  vocabulary shard and folds them into an online log-sum-exp, so full logits never exist.
  Backward recomputes each shard's logits, forms softmax - onehot and reduces dW_r to its owner.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tsp_impl.overlap import owner_shards
from tspbench.core.comm import Comm


class VocabEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: torch.Tensor, e_own: torch.Tensor, comm: Comm, overlap: bool):  # type: ignore[override]
        n = e_own.shape[0]
        x = e_own.new_zeros((*tokens.shape, e_own.shape[1]))
        for r, e in owner_shards(e_own, comm, overlap):
            # masked lookup, no data-dependent shapes (so it also runs on fake tensors)
            hit = (tokens >= r * n) & (tokens < (r + 1) * n)
            x = torch.where(hit[..., None], F.embedding((tokens - r * n).clamp(0, n - 1), e), x)
        ctx.save_for_backward(tokens)
        ctx.comm, ctx.shape = comm, e_own.shape
        return x

    @staticmethod
    def backward(ctx, dx: torch.Tensor):  # type: ignore[override]
        (tokens,) = ctx.saved_tensors
        comm: Comm = ctx.comm
        n, h = ctx.shape
        flat, g = tokens.flatten(), dx.flatten(0, 1)
        de_own, reducing = None, None
        for r in range(comm.size):
            hit = (flat >= r * n) & (flat < (r + 1) * n)  # masked: no data-dependent shapes
            de = g.new_zeros((n, h)).index_add_(0, (flat - r * n).clamp(0, n - 1), g * hit[:, None])
            if reducing is not None:  # at most one gradient reduce in flight
                reducing.wait()
            reducing = comm.reduce(de, dst=r, async_op=True)
            if r == comm.rank:
                de_own = de
        reducing.wait()
        return None, de_own, None, None


class VocabParallelLoss(torch.autograd.Function):
    """Sum over local tokens of cross-entropy, divided by the global token count."""

    @staticmethod
    def forward(ctx, x, w_own, labels, n_tokens: int, comm: Comm, overlap: bool):  # type: ignore[override]
        n = w_own.shape[0]
        m = torch.full(labels.shape, -torch.inf, device=x.device)
        s = torch.zeros(labels.shape, device=x.device)
        target = torch.zeros(labels.shape, device=x.device)
        for r, w in owner_shards(w_own, comm, overlap):
            logits = (x @ w.T).float()
            m_new = torch.maximum(m, logits.amax(-1))
            s = s * (m - m_new).exp() + (logits - m_new[..., None]).exp().sum(-1)
            m = m_new
            hit = (labels >= r * n) & (labels < (r + 1) * n)
            idx = (labels - r * n).clamp(0, n - 1)
            target += torch.where(hit, logits.gather(-1, idx[..., None])[..., 0], 0.0)
        lse = m + s.log()
        ctx.save_for_backward(x, w_own, labels, lse)
        ctx.comm, ctx.n_tokens, ctx.overlap = comm, n_tokens, overlap
        return (lse - target).sum() / n_tokens

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, w_own, labels, lse = ctx.saved_tensors
        comm: Comm = ctx.comm
        n = w_own.shape[0]
        dx = torch.zeros_like(x)
        dw_own, reducing = None, None
        scale = g / ctx.n_tokens
        for r, w in owner_shards(w_own, comm, ctx.overlap):
            p = ((x @ w.T).float() - lse[..., None]).exp()
            hit = (labels >= r * n) & (labels < (r + 1) * n)
            idx = (labels - r * n).clamp(0, n - 1)
            p.scatter_add_(-1, idx[..., None], -hit[..., None].float())
            dlogits = (p * scale).to(x.dtype)
            dx += dlogits @ w
            dw = dlogits.flatten(0, 1).T @ x.flatten(0, 1)
            if reducing is not None:  # at most one gradient reduce in flight
                reducing.wait()
            reducing = comm.reduce(dw, dst=r, async_op=True)
            if r == comm.rank:
                dw_own = dw
        reducing.wait()
        return dx, dw_own, None, None, None, None
