"""Mixture-of-experts MLP, dropless, as Mixtral, Qwen2-MoE and Qwen3-MoE define it.

A linear router scores each token against the E experts; softmax (fp32), top-k, and (Mixtral
always, Qwen where ``norm_topk_prob``) the k weights renormalised to sum to one. Every routed
token is computed (no capacity, nothing dropped), so a strategy that moves tokens or weights
differently still equals the reference exactly. Qwen2-MoE adds a shared SwiGLU expert that every
token passes through, scaled by a sigmoid gate of its own.

The router's load-balancing loss (Switch Transformer's, as HF's ``load_balancing_loss_func``
computes it over every layer's tokens together) is E * sum_e (n_e / N) * (P_e / N), with n_e
the top-k assignments to expert e and P_e the summed router probabilities, N the routed rows of
all layers. Only P carries a gradient, so a rank holding some tokens contributes
E / N^2 * sum_e n_e * P_e(local) with the global counts: the contributions sum to the loss and
its gradient, whatever the rank's share of the tokens (:func:`aux_loss_part`).

Under :func:`balanced`, routing ignores the scores: token i of a rank takes experts
(i k + j) mod E, j < k, so every expert gets t k / E rows of t tokens (within one), known
without looking at the data. The fake-tensor estimator routes so (fake tensors have no
data to route by), and so do the projections: even routing is their stated assumption.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tspbench.core import recompute
from tspbench.core.config import ModelConfig

# a MoE layer's parameters (in place of the dense MLP's w1, w3, w2): the router [E, h]; the
# experts' gate and up [E, f_e, h], down [E, h, f_e]; Qwen2-MoE's shared expert and its gate
ROUTER = ("router",)
EXPERTS = ("ew1", "ew3", "ew2")
SHARED = ("sw1", "sw3", "sw2", "sgate")


def moe_params(cfg: ModelConfig) -> tuple[str, ...]:
    """The MLP parameters of one MoE layer of ``cfg``."""
    return ROUTER + EXPERTS + SHARED * bool(cfg.shared_ffn)


def moe_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Their full shapes; the experts' weights stacked on a leading expert dimension."""
    h, E, fe, fs = cfg.hidden, cfg.experts, cfg.moe_ffn, cfg.shared_ffn
    shapes: dict[str, tuple[int, ...]] = {
        "router": (E, h), "ew1": (E, fe, h), "ew3": (E, fe, h), "ew2": (E, h, fe)
    }  # fmt: skip
    if fs:
        shapes.update(sw1=(fs, h), sw3=(fs, h), sw2=(h, fs), sgate=(1, h))
    return shapes


_even = [False]


@contextmanager
def balanced() -> Iterator[None]:
    """Route evenly, by position, in place of the router's top-k (module docstring)."""
    before, _even[0] = _even[0], True
    try:
        yield
    finally:
        _even[0] = before


def is_balanced() -> bool:
    """Whether :func:`balanced` routing is on."""
    return _even[0]


def even_counts(tokens: int, top_k: int, experts: int) -> list[int]:
    """Rows per expert of ``tokens`` tokens under :func:`balanced` routing: slot positions
    p = i k + j go to expert p mod E."""
    n = tokens * top_k
    return [len(range(e, n, experts)) for e in range(experts)]


def expert_counts(idx: torch.Tensor, experts: int) -> torch.Tensor:
    """Top-k assignments per expert of the routed slots ``idx`` [t, k] (int64: exact); under
    :func:`balanced` routing from the shape alone."""
    if _even[0]:
        t, k = idx.shape
        return torch.tensor(even_counts(t, k, experts), device=idx.device)
    return torch.bincount(idx.flatten(), minlength=experts)


def rows_of(idx: torch.Tensor, e: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, slots) routed to expert ``e`` of ``experts`` by ``idx`` [t, k]; under
    :func:`balanced` routing from the shape alone (slot positions e, e + E, ...)."""
    if not _even[0]:
        tok, slot = torch.where(idx == e)
        return tok, slot
    t, k = idx.shape
    n = len(range(e, t * k, experts))
    rows = torch.empty(2, n, dtype=torch.int64, device=idx.device)  # one storage, as where's
    torch.arange(e, t * k, experts, out=rows[1])  # slot positions p
    torch.div(rows[1], k, rounding_mode="floor", out=rows[0])  # tokens p // k
    return rows[0], rows[1].remainder_(k)  # slots p mod k


@dataclass
class RouterStats:
    """What the load-balancing loss needs of the layers run so far on this rank's tokens:
    top-k assignments per expert (no gradient) and router probabilities summed per expert
    (with it)."""

    counts: list[torch.Tensor] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)

    def add(self, probs: torch.Tensor, idx: torch.Tensor) -> None:
        """Count one layer's routing (not again while backward recomputes the layer: the
        forward's sums carry the gradient)."""
        if recompute.active():
            return
        self.counts.append(expert_counts(idx, probs.shape[-1]))
        self.probs.append(probs.sum(0))


def route(
    m: torch.Tensor,
    router: torch.Tensor,
    top_k: int,
    norm_topk: bool,
    stats: RouterStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs [T, E] fp32 (fp64 for fp64), weights [T, k] in m's dtype, experts [T, k]) of the
    tokens m [T, h]: softmax over the router's logits, the k largest, renormalised where the
    family does; counted in ``stats`` (the load-balancing loss's) where given."""
    acc = torch.float64 if m.dtype == torch.float64 else torch.float32
    probs = F.softmax((m @ router.T).to(acc), dim=-1)
    if _even[0]:
        E = probs.shape[-1]
        idx = (torch.arange(m.shape[0] * top_k, device=m.device) % E).view(-1, top_k)
        weights = probs.gather(-1, idx)
    else:
        weights, idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    if stats is not None:
        stats.add(probs, idx)
    return probs, weights.to(m.dtype), idx


def expert_ffn(
    x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """One SwiGLU expert on its tokens x [n, h]."""
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def routed_experts(
    m: torch.Tensor,
    weights: torch.Tensor,
    idx: torch.Tensor,
    p: dict[str, torch.Tensor],
    first: int,
    experts: int,
) -> torch.Tensor:
    """sum over each token's routed experts of weight x expert(token), for the experts
    ``first`` .. ``first + len(p['ew1'])`` whose weights ``p`` holds (all of them in the
    reference; an expert-parallel rank's own); tokens routed elsewhere get zeros. An expert no
    token reached still runs (on no rows): its gradient is zeros, not missing, on every rank
    and in every strategy alike (AdamW moves a weight with a zero gradient, not one without).
    ``experts``: E, of which ``p`` holds some or all."""
    out = torch.zeros_like(m)
    for j in range(p["ew1"].shape[0]):
        tok, slot = rows_of(idx, first + j, experts)
        y = expert_ffn(m[tok], p["ew1"][j], p["ew3"][j], p["ew2"][j])
        out = out.index_add(0, tok, y * weights[tok, slot, None])
    return out


def shared_expert(m: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """Qwen2-MoE's shared expert, scaled by sigmoid of its own gate."""
    return torch.sigmoid(m @ p["sgate"].T) * expert_ffn(m, p["sw1"], p["sw3"], p["sw2"])


def moe_mlp(
    m: torch.Tensor,
    p: dict[str, torch.Tensor],
    top_k: int,
    norm_topk: bool,
    stats: RouterStats | None = None,
) -> torch.Tensor:
    """The MoE MLP on the normed tokens m [..., h] with the whole layer's weights ``p``;
    ``stats`` collects what the load-balancing loss needs."""
    shape = m.shape
    m = m.reshape(-1, shape[-1])
    _, weights, idx = route(m, p["router"], top_k, norm_topk, stats)
    out = routed_experts(m, weights, idx, p, 0, p["router"].shape[0])
    if "sgate" in p:
        out = out + shared_expert(m, p)
    return out.view(shape)


def aux_loss_part(stats: RouterStats, counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """This rank's share of the load-balancing loss: E / N^2 * sum_e n_e * P_e(local), with
    ``counts`` (n_e) over every rank's tokens and layers, and N = sum_e n_e / k the rows they
    routed (a tensor: no host sync): the shares sum to HF's loss and to its gradient."""
    local = torch.stack(stats.probs).sum(0)
    rows = counts.sum().to(local.dtype) / top_k
    return (counts.to(local.dtype) * local).sum() * counts.numel() / rows**2


def local_counts(stats: RouterStats) -> torch.Tensor:
    """This rank's top-k assignments per expert, summed over its layers."""
    return torch.stack(stats.counts).sum(0)
