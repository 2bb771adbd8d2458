"""The single-device reference model: the oracle every strategy is checked against.

Written with plain autograd and PyTorch's own SDPA (full causal mask), independent of the attention
kernels and schedules the strategies use, so a bug there cannot hide in the reference too.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from tspbench.core import init, moe
from tspbench.core.config import ModelConfig
from tspbench.core.layers import LayerHooks, cached, rms_norm, rope_on, transformer_layer

LAYER_PARAMS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w1", "w3", "w2")
QK_NORMS = ("q_norm", "k_norm")  # Qwen3's per-head RMSNorms on Q and K, [head_dim] each
QKV_BIASES = ("bq", "bk", "bv")  # Qwen2's biases of the Q, K and V projections
MLP_BIASES = ("b1", "b3", "b2")  # Llama's mlp_bias: of W1 (gate), W3 (up), W2 (down)
# the biases added to a layer's outputs, after a tensor-parallel reduction: whole on every rank
OUTPUT_BIASES = ("bo", "b2")


def layer_params(cfg: ModelConfig) -> tuple[str, ...]:
    """The parameters of one layer of ``cfg``: Llama's nine, then the QK norms and the biases
    where it has them."""
    dense = LAYER_PARAMS if not cfg.moe else LAYER_PARAMS[:6] + moe.moe_params(cfg)
    return (
        dense + QK_NORMS * cfg.qk_norm + QKV_BIASES * cfg.qkv_bias
        + ("bo",) * cfg.o_bias + MLP_BIASES * cfg.mlp_bias
    )  # fmt: skip


def head_name(cfg: ModelConfig) -> str:
    """The LM head's parameter: ``head``, or with tied embeddings the embedding itself."""
    return "embed" if cfg.tie_embeddings else "head"


def is_norm(name: str) -> bool:
    """Whether a parameter is a norm weight (initialised to ones; every other one is random)."""
    return name.rsplit(".", 1)[-1] in ("attn_norm", "mlp_norm", "norm", *QK_NORMS)


def unit_names(cfg: ModelConfig) -> list[list[str]]:
    """The parameters of each unit a fully sharded model gathers at once (FSDP+CP, FSDP2+CP):
    the embedding; each layer; the final norm with the LM head (tied: the norm alone, the head
    being the first unit's embedding)."""
    layers = [[f"layers.{i}.{k}" for k in layer_params(cfg)] for i in range(cfg.layers)]
    return [["embed"], *layers, ["norm"] if cfg.tie_embeddings else ["norm", "head"]]


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Full parameter shapes by name; weights are [out, in] as in nn.Linear."""
    h, f, kv, q = cfg.hidden, cfg.ffn, cfg.kv_dim, cfg.q_dim
    layer = {
        "attn_norm": (h,),
        "wq": (q, h),
        "wk": (kv, h),
        "wv": (kv, h),
        "wo": (h, q),
        "mlp_norm": (h,),
        **({"w1": (f, h), "w3": (f, h), "w2": (h, f)} if not cfg.moe else moe.moe_shapes(cfg)),
        **{k: (cfg.d_head,) for k in QK_NORMS if cfg.qk_norm},
        **({"bq": (q,), "bk": (kv,), "bv": (kv,)} if cfg.qkv_bias else {}),
        **({"bo": (h,)} if cfg.o_bias else {}),
        **({"b1": (f,), "b3": (f,), "b2": (h,)} if cfg.mlp_bias else {}),
    }
    shapes: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab, h)}
    for i in range(cfg.layers):
        shapes.update({f"layers.{i}.{k}": s for k, s in layer.items()})
    shapes["norm"] = (h,)
    if not cfg.tie_embeddings:
        shapes["head"] = (cfg.vocab, h)
    return shapes


def init_param(
    cfg: ModelConfig,
    name: str,
    seed: int,
    rows: init.Index = None,
    cols: init.Index = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Deterministic fp32 ``full[rows][:, cols]`` of one parameter, made on ``device``.

    Each element is a function of (seed, name, its index in the full tensor) only, so every
    strategy generates just its shard and all start from bit-identical weights (norms: ones;
    a bias: random as a weight, a [n, 1] column; the experts' [E, a, b] stacks: an [E * a, b]
    weight, ``rows`` indexing its first dimension, so an expert's own rows are contiguous).
    """
    shape = param_shapes(cfg)[name]
    if len(shape) == 3:
        E, a, b = shape
        rows = slice(None) if rows is None else rows
        ix = torch.arange(E)[rows]  # the experts wanted, in order
        flat = (ix[:, None] * a + torch.arange(a)[None, :]).flatten()
        keys = init.param_keys(seed, name)
        out = init.block((E * a, b), keys, cfg.init_std, flat, cols, device)
        return out.view(len(ix), a, out.shape[-1])
    if len(shape) == 1 and is_norm(name):
        return torch.ones(shape, device=device)[rows if rows is not None else slice(None)]
    if len(shape) == 1:
        keys = init.param_keys(seed, name)
        return init.block((shape[0], 1), keys, cfg.init_std, rows, None, device)[:, 0]
    return init.block(shape, init.param_keys(seed, name), cfg.init_std, rows, cols, device)


def init_param_flat(
    cfg: ModelConfig, name: str, seed: int, start: int, stop: int, device: torch.device | str
) -> torch.Tensor:
    """Elements [start, stop) of one parameter's flattened full fp32 value (FSDP's shards)."""
    shape = param_shapes(cfg)[name]
    if len(shape) == 1 and is_norm(name):
        return torch.ones(max(0, min(stop, shape[0]) - max(0, start)), device=device)
    numel = math.prod(shape)
    return init.flat_range(numel, init.param_keys(seed, name), cfg.init_std, start, stop, device)


def make_batch(
    cfg: ModelConfig, batch: int, seq_len: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic global batch of (tokens, labels), each [batch, seq_len] int64."""
    g = torch.Generator().manual_seed(seed + 7)
    ids = torch.randint(0, cfg.vocab, (batch, seq_len + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


class ReferenceModel(torch.nn.Module):
    """Single-device Llama-style model; ``forward`` returns final normed hidden states [B, S, h]."""

    def __init__(
        self,
        cfg: ModelConfig,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.params = torch.nn.ParameterDict(
            {
                n.replace(".", "_"): torch.nn.Parameter(
                    init_param(cfg, n, seed, device=device).to(dtype)
                )
                for n in param_shapes(cfg)
            }
        )

    def p(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "_")]

    def head(self) -> torch.Tensor:
        """The LM head's weight [V, h]: ``head``, or the embedding where they are tied."""
        return self.p(head_name(self.cfg))

    def named_full_params(self) -> dict[str, torch.Tensor]:
        return {n: self.p(n) for n in param_shapes(self.cfg)}

    def forward(
        self,
        tokens: torch.Tensor,
        layer_call=None,
        hooks: LayerHooks | None = None,
        stats: moe.RouterStats | None = None,
    ) -> torch.Tensor:
        """Final normed hidden states; ``layer_call(fn, *args)`` wraps each layer (recompute);
        ``hooks`` (default: the single-device layer, PyTorch's SDPA) picks the attention;
        ``stats`` collects the routing of a model with experts (the load-balancing loss)."""
        cfg = self.cfg
        layer_call = layer_call or (lambda fn, *args: fn(*args))
        hooks = hooks or LayerHooks()
        if cfg.moe and hooks.moe is None:  # every expert here: dropless, no communication
            hooks = dataclasses.replace(
                hooks,
                moe=lambda m, p: moe.moe_mlp(m, p, cfg.top_k, cfg.norm_topk, stats),
            )
        x = F.embedding(tokens, self.p("embed"))
        L = tokens.shape[1]
        key = ("rope", L, x.dtype, x.device)
        cos, sin = cached(self, key, lambda: rope_on(torch.arange(L), cfg, x))
        for i in range(cfg.layers):
            p = {k: self.p(f"layers.{i}.{k}") for k in layer_params(cfg)}
            x = layer_call(transformer_layer, x, p, cfg.norm_eps, cfg.d_head, cos, sin, hooks)
        return rms_norm(x, self.p("norm"), cfg.norm_eps)

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean cross-entropy over all tokens, plus the load-balancing loss where the model
        has one, final hidden states)."""
        stats = moe.RouterStats() if self.cfg.aux_loss else None
        hidden = self.forward(tokens, stats=stats)
        logits = hidden @ self.head().T
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp64 stays
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        if stats is None:
            return ce, hidden
        aux = moe.aux_loss_part(stats, moe.local_counts(stats), self.cfg.top_k)
        return ce + self.cfg.aux_loss * aux, hidden
