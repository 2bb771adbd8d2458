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

Each is plain functions (``embedding_forward``/``embedding_backward``, ``loss_forward``/
``loss_backward``) under a thin autograd.Function (``VocabEmbedding``, ``VocabParallelLoss``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tsp_impl.ops import accumulate
from tsp_impl.overlap import OneInFlight, owner_shards
from tspbench.core import recompute
from tspbench.core.comm import Comm


def shard_rows(ids: torch.Tensor, n: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hits [D, *ids.shape]: which shard holds each id, rows: its row in that shard)."""
    owner = ids.div(n, rounding_mode="floor")
    hits = owner == torch.arange(D, device=ids.device).view(-1, *[1] * ids.dim())
    return hits, ids.remainder(n)


def embedding_forward(
    tokens: torch.Tensor, e_own: torch.Tensor, comm: Comm, overlap: bool
) -> torch.Tensor:
    """The local tokens' embeddings [B, S/D, h], owner by owner (backward needs the tokens)."""
    n = e_own.shape[0]
    # masked lookup, no data-dependent shapes (so it also runs on fake tensors)
    hits, rows = shard_rows(tokens, n, comm.size)
    x = None
    for r, e in owner_shards(e_own, comm, overlap):
        found = F.embedding(rows, e)
        hit = hits[r, ..., None]
        x = found.mul_(hit) if x is None else torch.where(hit, found, x)
    assert x is not None  # (D >= 1 owners)
    return x


def embedding_backward(
    dx: torch.Tensor, tokens: torch.Tensor, shape: torch.Size, comm: Comm
) -> torch.Tensor:
    """This rank's embedding gradient [V/D, h] (``shape``): each owner's rows are filled from
    the local tokens' gradients and reduced to it, one reduce in flight while the next fills."""
    n, h = shape
    hits, rows = shard_rows(tokens.flatten(), n, comm.size)
    g = dx.flatten(0, 1)
    de_own, reduces = None, OneInFlight(comm)
    for r in range(comm.size):
        de = g.new_zeros((n, h)).index_add_(0, rows, g * hits[r, :, None])  # masked
        reduces.reduce(de, dst=r)
        if r == comm.rank:
            de_own = de
    reduces.drain()
    assert de_own is not None  # (this rank is one of the owners)
    return de_own


def loss_forward(
    x: torch.Tensor,
    w_own: torch.Tensor,
    labels: torch.Tensor,
    n_tokens: int,
    comm: Comm,
    overlap: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the local tokens' summed cross-entropy / ``n_tokens``, their log-sum-exp over the whole
    vocabulary for backward), the head shards broadcast owner by owner."""
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
    return (lse - target).sum() / n_tokens, lse


def loss_backward(
    g: torch.Tensor,
    x: torch.Tensor,
    w_own: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    n_tokens: int,
    comm: Comm,
    overlap: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dX, this rank's head gradient): each shard's logits recomputed, softmax - onehot, dW_r
    reduced to its owner while the next shard computes."""
    n = w_own.shape[0]
    hits, rows = shard_rows(labels, n, comm.size)
    scale = g / n_tokens
    onehot = hits.unsqueeze(-1).to(torch.float32).neg_()  # -1 at the label, where held
    x2, rows2 = x.flatten(0, 1), rows.flatten()[:, None]
    dlogits = x2.new_empty((x2.shape[0], n))  # (p * scale) in x's dtype, shard by shard
    dx, dw_own, reduces = None, None, OneInFlight(comm)
    for r, w in owner_shards(w_own, comm, overlap):
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
        reduces.reduce(dw, dst=r)
        if r == comm.rank:
            dw_own = dw
    reduces.drain()
    assert dx is not None and dw_own is not None  # (D >= 1 owners, this rank one of them)
    return dx.view_as(x), dw_own


class VocabEmbedding(torch.autograd.Function):
    """The embedding lookup over vocabulary shards: :func:`embedding_forward`,
    :func:`embedding_backward`."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, e_own: torch.Tensor, comm: Comm, overlap: bool):
        x = embedding_forward(tokens, e_own, comm, overlap)
        ctx.save_for_backward(tokens)
        ctx.comm, ctx.shape = comm, e_own.shape
        return x

    @staticmethod
    def backward(ctx, dx: torch.Tensor):
        (tokens,) = ctx.saved_tensors
        return None, embedding_backward(dx, tokens, ctx.shape, ctx.comm), None, None


class VocabParallelLoss(torch.autograd.Function):
    """Sum over local tokens of cross-entropy, divided by the global token count:
    :func:`loss_forward`, :func:`loss_backward`."""

    @staticmethod
    def forward(ctx, x, w_own, labels, n_tokens: int, comm: Comm, overlap: bool):
        loss, lse = loss_forward(x, w_own, labels, n_tokens, comm, overlap)
        ctx.save_for_backward(x, w_own, labels, lse)
        ctx.comm, ctx.n_tokens, ctx.overlap = comm, n_tokens, overlap
        return loss

    @staticmethod
    def backward(ctx, g):
        x, w_own, labels, lse = ctx.saved_tensors
        dx, dw_own = loss_backward(g, x, w_own, labels, lse, ctx.n_tokens, ctx.comm, ctx.overlap)
        return dx, dw_own, None, None, None, None
