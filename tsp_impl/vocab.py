"""TSP embedding and LM head/loss over vocabulary shards (``docs/method.md`` §5).

Rank r owns rows [r*V/D, (r+1)*V/D) of the embedding and of the LM head. Both are driven by the
same broadcast schedule as attention, so no activation ever moves:
- Embedding: each owner broadcasts its rows; every rank looks up the local tokens that fall in
  them. Backward, owner by owner: each rank adds its tokens' gradients for that owner's rows
  into a [V/D, h] buffer and reduces it to the owner (one reduce in flight while the next
  buffer fills), so no rank ever holds a [V, h] gradient. Same bytes as one reduce-scatter of
  [V, h]: D reduces of [V/D, h], (D-1)/D of it each on average.
- Loss: each owner broadcasts its head rows; every rank computes its local tokens' logits for that
  vocabulary shard and keeps their log-sum-exp, so full logits never exist.
  Backward recomputes each shard's logits, forms softmax - onehot and reduces dW_r to its owner.

Which shard holds each token (label) and its row there are computed once per call, for all
shards at once; the loss keeps one log-sum-exp and one target logit per shard ([D, tokens]) and
combines them after the loop (a log-sum-exp over the shards), rather than updating running
ones shard by shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tsp_impl.ops import accumulate
from tsp_impl.overlap import owner_shards
from tspbench.core import recompute
from tspbench.core.comm import Comm


def shard_rows(ids: torch.Tensor, n: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hits [D, *ids.shape]: which shard holds each id, rows: its row in that shard)."""
    owner = ids.div(n, rounding_mode="floor")
    hits = owner == torch.arange(D, device=ids.device).view(-1, *[1] * ids.dim())
    return hits, ids.remainder(n)


class VocabEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: torch.Tensor, e_own: torch.Tensor, comm: Comm, overlap: bool):  # type: ignore[override]
        n = e_own.shape[0]
        # masked lookup, no data-dependent shapes (so it also runs on fake tensors)
        hits, rows = shard_rows(tokens, n, comm.size)
        x = None
        for r, e in owner_shards(e_own, comm, overlap):
            found = F.embedding(rows, e)
            hit = hits[r, ..., None]
            x = found.mul_(hit) if x is None else torch.where(hit, found, x)
        ctx.save_for_backward(tokens)
        ctx.comm, ctx.shape = comm, e_own.shape
        return x

    @staticmethod
    def backward(ctx, dx: torch.Tensor):  # type: ignore[override]
        (tokens,) = ctx.saved_tensors
        comm: Comm = ctx.comm
        n, h = ctx.shape
        hits, rows = shard_rows(tokens.flatten(), n, comm.size)
        g = dx.flatten(0, 1)
        de_own, reducing = None, None
        for r in range(comm.size):
            de = g.new_zeros((n, h)).index_add_(0, rows, g * hits[r, :, None])  # masked
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
        hits, rows = shard_rows(labels, n, comm.size)
        lses = x.new_empty((comm.size, *labels.shape), dtype=torch.float32)
        targets = torch.empty_like(lses)
        for r, w in owner_shards(w_own, comm, overlap):
            logits = (x @ w.T).float()
            torch.logsumexp(logits, -1, out=lses[r])
            torch.gather(logits, -1, rows[..., None], out=targets[r, ..., None])
        lse = torch.logsumexp(lses, 0)
        target = targets.mul_(hits).sum(0)  # the label's logit, from the shard that holds it
        ctx.save_for_backward(x, w_own, labels, lse)
        ctx.comm, ctx.n_tokens, ctx.overlap = comm, n_tokens, overlap
        return (lse - target).sum() / n_tokens

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, w_own, labels, lse = ctx.saved_tensors
        comm: Comm = ctx.comm
        n = w_own.shape[0]
        hits, rows = shard_rows(labels, n, comm.size)
        scale = g / ctx.n_tokens
        onehot = hits.unsqueeze(-1).to(torch.float32).neg_()  # -1 at the label, where held
        x2, rows2 = x.flatten(0, 1), rows.flatten()[:, None]
        dlogits = x2.new_empty((x2.shape[0], n))  # (p * scale) in x's dtype, shard by shard
        dx, dw_own, reducing = None, None, None
        for r, w in owner_shards(w_own, comm, ctx.overlap):
            # this shard's softmax: x's-dtype logits minus the fp32 lse promote to fp32; the
            # logits are forward's again (recomputed: no model FLOPs)
            with recompute.recomputing():
                logits = x2 @ w.T
            p = torch.sub(logits, lse.view(-1, 1)).exp_()
            del logits
            p.scatter_add_(-1, rows2, onehot[r].flatten(0, -2))
            torch.mul(p, scale, out=dlogits)
            del p
            dx = accumulate(dx, dlogits, w)
            dw = dlogits.T @ x2
            if reducing is not None:  # at most one gradient reduce in flight
                reducing.wait()
            reducing = comm.reduce(dw, dst=r, async_op=True)
            if r == comm.rank:
                dw_own = dw
        reducing.wait()
        return dx.view_as(x), dw_own, None, None, None, None
