"""Small math shared by the reference and every strategy: RMSNorm, RoPE, SiLU and its derivative."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F

from tspbench.core import rope
from tspbench.core.config import ModelConfig

T = TypeVar("T")


def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): y = x * rstd * weight computed in fp32 (fp64 for fp64 inputs) and cast to
    x's dtype, and the per-token rstd = 1/rms(x) [..., 1] in that precision, all the backward
    needs besides x and the weight."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32  # not promote_types:
    # that is a dispatched operation, one more per norm in every count
    rstd = torch.rsqrt(x.to(acc).pow(2).mean(-1, keepdim=True) + eps)
    y = (x * rstd).mul_(weight.to(acc))  # x * fp32 rstd promotes: no fp32 copy of x is kept
    return y.to(x.dtype), rstd


def rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    need_dx: bool = True,
    need_dw: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dx, dweight) of :func:`rms_norm_fwd`, in fp32 from the normalised input x * rstd
    recomputed here, so that forward need not keep it; dweight sums over all leading dims."""
    xhat = x * rstd
    dw = (dy * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype) if need_dw else None
    if not need_dx:
        return None, dw
    gw = dy * weight.to(rstd.dtype)
    # dx = rstd * (gw - xhat * mean(gw * xhat)); xhat and gw are fp32 buffers of our own
    dx = gw.sub_(xhat.mul_((gw * xhat).mean(-1, keepdim=True))).mul_(rstd)
    return dx.to(x.dtype), dw


class _RMSNorm(torch.autograd.Function):
    """Autograd keeps only x (its own dtype), the weight and the fp32 rstd, as fused norms do,
    not the fp32 copies and intermediates of the plain formula (most of a TP layer's bytes)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = rms_norm_fwd(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_bwd(dy, x, weight, rstd, *ctx.needs_input_grad[:2])
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, cast back to the input dtype; saves nothing without grad."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    return rms_norm_fwd(x, weight, eps)[0]


def rope_tables(
    pos: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [len(pos), head_dim] for the given *global* positions (rotate-half
    layout), with ``cfg``'s head dim, theta and RoPE scaling (tspbench/core/rope.py), in fp64."""
    inv, attention = rope.inv_freq(cfg.rope_scaling, cfg.d_head, cfg.rope_theta)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return (ang.cos() * attention).to(dtype), (ang.sin() * attention).to(dtype)


def rope_on(
    pos: torch.Tensor, cfg: ModelConfig, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_tables` for ``pos`` in ``like``'s dtype, on its device."""
    cos, sin = rope_tables(pos, cfg, like.dtype)
    return cos.to(like.device), sin.to(like.device)


def cached(owner: object, key: Hashable, make: Callable[[], T]) -> T:
    """``make()``, built once per ``owner`` (a strategy, the reference model) and ``key``: the
    tables that depend only on the sequence length (RoPE at the local tokens' positions, the
    zigzag gather orders) stay with their owner, as TSP's plan keeps its own
    (tsp_impl/plan.py), so that no strategy rebuilds them inside a timed step."""
    store = owner.__dict__.setdefault("_cached_tables", {})
    if key not in store:
        store[key] = make()
    return store[key]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, L, d] by the tables [L, d]. Passing -sin applies the inverse (the VJP)."""
    return x * cos + _rotate_half(x) * sin


def silu_grad(z: torch.Tensor) -> torch.Tensor:
    """d silu(z) / dz."""
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def in_proj(a: torch.Tensor, p: dict[str, torch.Tensor], w: str) -> torch.Tensor:
    """``a @ p[w].T`` for a column-parallel w (wq, wk, wv, w1, w3), plus its bias (bq, bk, bv:
    Qwen2, Llama's attention_bias; b1, b3: Llama's mlp_bias) where the layer has one: one addmm
    then, no separate add. A bias is split with its weight's rows."""
    bias = p.get("b" + w[1])
    return a @ p[w].T if bias is None else F.linear(a, p[w], bias)


def out_proj(
    o: torch.Tensor,
    p: dict[str, torch.Tensor],
    w: str,
    exit: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``exit(o @ p[w].T)`` for a row-parallel w (wo, w2), plus its bias (bo, b2) where the
    layer has one: added after ``exit``'s reduction, once, as Megatron's RowParallelLinear adds
    it (the bias is whole on every rank)."""
    y = exit(o @ p[w].T)
    bias = p.get("b" + w[1])
    return y if bias is None else y + bias


def rotate_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    p: dict[str, torch.Tensor],
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on the heads of q and k (any layout with the head dim last), each head normed first
    where the layer has ``q_norm`` and ``k_norm`` (Qwen3)."""
    if "q_norm" in p:
        q, k = rms_norm(q, p["q_norm"], eps), rms_norm(k, p["k_norm"], eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


@dataclass
class LayerHooks:
    """Where a parallel strategy plugs its communication into :func:`transformer_layer`.

    enter: on each normed input before the column-parallel projections (TP: identity forward,
    all-reduce backward); exit: on each row-parallel output (TP: all-reduce forward);
    gather_kv: on local (k, v) (context parallel: all-gather the sequence); attn: the kernel;
    moe: the whole mixture-of-experts MLP on the normed tokens (a layer with experts needs one:
    routing, and where the experts live, are the strategy's). The defaults are the
    single-device model.
    """

    enter: Callable[[torch.Tensor], torch.Tensor] = _identity
    exit: Callable[[torch.Tensor], torch.Tensor] = _identity
    gather_kv: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = (
        lambda k, v: (k, v)
    )
    attn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = _causal_sdpa
    moe: Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor] | None = None


def transformer_layer(
    x: torch.Tensor,
    p: dict[str, torch.Tensor],
    eps: float,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    hooks: LayerHooks,
) -> torch.Tensor:
    """One pre-norm Llama block on x [B, L, h] with (possibly sharded) weights ``p`` (with
    ``q_norm`` and ``k_norm``: Qwen3's, each head's Q and K normed before RoPE; with ``bq``,
    ``bk``, ``bv``: Qwen2's QKV biases; with ``bo``, ``b1``, ``b3``, ``b2``: Llama's attention
    output and MLP biases; with ``router``: a mixture of experts, ``hooks.moe``).

    Head counts follow from the weight shapes, so a TP shard of Wq simply yields fewer heads.
    The attention and the MLP are functions of their own, as ``nn.Module``s are: a forward-only
    step frees the attention's locals (normed input, Q, K/V, output) before the MLP runs.
    """
    B, L, _ = x.shape

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(B, L, -1, head_dim).transpose(1, 2)

    def attention(x: torch.Tensor) -> torch.Tensor:
        a = hooks.enter(rms_norm(x, p["attn_norm"], eps))
        q, k = rotate_qk(heads(in_proj(a, p, "wq")), heads(in_proj(a, p, "wk")), p, eps, cos, sin)
        k, v = hooks.gather_kv(k, heads(in_proj(a, p, "wv")))
        o = hooks.attn(q, k, v).transpose(1, 2).flatten(2)
        return out_proj(o, p, "wo", hooks.exit)

    def mlp(x: torch.Tensor) -> torch.Tensor:
        if "router" in p:  # experts: the strategy's MoE block, its communication its own
            if hooks.moe is None:
                raise ValueError("a layer with experts needs LayerHooks.moe")
            return hooks.moe(rms_norm(x, p["mlp_norm"], eps), p)
        m = hooks.enter(rms_norm(x, p["mlp_norm"], eps))
        return out_proj(F.silu(in_proj(m, p, "w1")) * in_proj(m, p, "w3"), p, "w2", hooks.exit)

    x = x + attention(x)
    return x + mlp(x)
