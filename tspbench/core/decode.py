"""Decode (``docs/decode.md``): the interface every strategy answers, and the pieces the plain
layers share: one decode layer with hooks, prefill into a cache, the greedy choice over a
vocabulary split, Megatron's KV-head replication and the closed forms of bytes and cache size.

:class:`Decoder` is what a strategy's ``decoder`` implements (docs/adding-a-strategy.md); a
strategy without a decode path says ``decoder = None``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from tspbench.core import costs
from tspbench.core.comm import Comm
from tspbench.core.config import ConfigError, ModelConfig
from tspbench.core.init import Index, chunk_slice
from tspbench.core.kvcache import KVCache, Step, partial_attention
from tspbench.core.layers import (
    LayerHooks,
    in_proj,
    out_proj,
    rms_norm,
    rope_tables,
    rotate_qk,
    transformer_layer,
)
from tspbench.core.reference import layer_params, param_shapes

FP32 = 4


class Decoder(ABC):
    """A strategy's decode path (its ``decoder``; None where it has none): built on the
    strategy's model (``self.model``), it prefills a KV cache, then steps one greedy token per
    sequence; its closed forms (the step's collectives, the cache's split) say what it costs.
    Everything a silent default would get wrong is abstract."""

    def __init__(self, model: Any) -> None:
        """``model``: the strategy instance whose weights and groups the decode runs on."""
        self.model = model

    @classmethod
    def validate(
        cls, strategy: Any, cfg: ModelConfig, layout, prompt_len: int, new_tokens: int,
        batch: int, **options: Any,
    ) -> None:  # fmt: skip
        """Raise ConfigError (field, value, rule) for a decode run of ``strategy`` (its class)
        this path cannot do (``options``: the run's values of the strategy's own options)."""
        for field in ("degree", "tp", "sp", "dp"):
            v = getattr(layout, field)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{field}={v!r}: must be a positive integer")
        if new_tokens < 2:
            raise ConfigError(
                f"new_tokens={new_tokens}: must be at least 2 (the prefill gives the first "
                "token, decode steps the rest)"
            )
        if layout.dp != 1:
            raise ConfigError(f"dp={layout.dp}: decode runs one model group (dp=1)")
        if batch < 1 or prompt_len < 1:
            raise ConfigError(f"batch={batch}, prompt_len={prompt_len}: must be positive")

    @abstractmethod
    def prefill(self, tokens: torch.Tensor, max_len: int) -> tuple[KVCache, Step]:
        """Run the prompt [B, P] (on every rank), keep its K/V in a cache with room for
        ``max_len`` tokens; return the cache and the last prompt position's step (collective)."""

    @abstractmethod
    def decode_step(self, cache: KVCache, tokens: torch.Tensor) -> Step:
        """Append ``tokens`` [B] (on every rank) to the cache; the next step (collective)."""

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, new_tokens: int) -> tuple[KVCache, list[Step]]:
        """Greedy generation of ``new_tokens`` tokens per sequence: prefill, then steps."""
        cache, step = self.prefill(tokens, tokens.shape[1] + new_tokens - 1)
        steps = [step]
        for _ in range(new_tokens - 1):
            steps.append(self.decode_step(cache, steps[-1].tokens))
        return cache, steps

    # -- closed forms (docs/decode.md sections 3 and 4) -------------------------------------------
    @classmethod
    @abstractmethod
    def schedule(cls, spec: costs.Spec) -> costs.Schedule:
        """The collectives one rank issues in one decode step."""

    @classmethod
    @abstractmethod
    def prefill_schedule(cls, spec: costs.Spec) -> costs.Schedule:
        """The collectives one rank issues in the prefill of ``spec`` (a forward pass over the
        prompt, ``--mode infer``): the strategy's forward without its loss, then what brings
        the last position's hidden state to the ranks holding the LM head and picks the next
        token (:func:`last_token_events`, :func:`greedy_events`)."""

    @classmethod
    @abstractmethod
    def cache_split(cls, layout) -> tuple[int, int]:
        """(ranks splitting the cached sequence, ranks splitting the KV heads)."""

    @classmethod
    def kv_cache_bytes(cls, spec: costs.Spec) -> int:
        """Bytes of one rank's KV cache, allocated for prompt + new_tokens - 1 tokens."""
        cfg, P = spec.cfg, spec.seq_len
        seq, heads = cls.cache_split(spec.layout)
        slots = KVCache.capacity(P, P + spec.new_tokens - 1, seq)  # type: ignore[attr-defined]
        kv_heads = kv_heads_local(cfg.kv_heads, heads)
        return 2 * cfg.layers * spec.batch * slots * kv_heads * cfg.d_head * spec.e


# -- Megatron's KV heads ---------------------------------------------------------------------------
def check_kv_split(cfg: ModelConfig, T: int, what: str = "T") -> None:
    """KV heads split over T ranks, or replicated (n_kv < T): one must divide the other."""
    if cfg.kv_heads % T and T % cfg.kv_heads:
        raise ConfigError(
            f"model.kv_heads={cfg.kv_heads}: must divide or be divisible by {what}={T} "
            "(KV heads are split, or replicated when fewer than the ranks)"
        )


def kv_heads_local(kv_heads: int, T: int) -> int:
    """KV heads one of T tensor-parallel ranks holds (one, replicated, when n_kv < T)."""
    return max(kv_heads // T, 1)


def kv_rows(cfg: ModelConfig, T: int, r: int) -> slice:
    """Rows of Wk/Wv that tensor-parallel rank r holds: its n_kv/T heads, or (n_kv < T) the one
    head its query heads read, as Megatron replicates KV heads."""
    d, n = cfg.d_head, kv_heads_local(cfg.kv_heads, T)
    first = r * n if cfg.kv_heads >= T else r * cfg.kv_heads // T
    return slice(first * d, (first + n) * d)


def megatron_block(cfg: ModelConfig, name: str, T: int, r: int, dim) -> tuple[Index, Index]:
    """(rows, cols) of a full parameter in rank r's Megatron shard (``dim``: its shard dim, None:
    whole), for :meth:`Strategy.init_block` to generate only that block."""
    if dim is None:
        return None, None
    if name.rsplit(".", 1)[-1] in ("wk", "wv", "bk", "bv") and cfg.kv_heads < T:
        return kv_rows(cfg, T, r), None
    part = chunk_slice(param_shapes(cfg)[name][dim], T, r)
    return (part, None) if dim == 0 else (None, part)


# -- one decode layer ---------------------------------------------------------------------------
def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass
class DecodeHooks:
    """How a strategy plugs its cache and communication into :func:`decode_layer`.

    attend(layer, q [B, Hq, d], k, v [B, Hkv, d]) -> the attention output [B, H_o, d] of the heads
    whose Wo columns this rank applies; exit: on each row-parallel output (TP: all-reduce)."""

    attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    exit: Callable[[torch.Tensor], torch.Tensor] = _identity


def decode_layer(
    i: int,
    x: torch.Tensor,
    p: dict[str, torch.Tensor],
    eps: float,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    hooks: DecodeHooks,
) -> torch.Tensor:
    """Layer ``i`` of the Llama block for one new token per sequence, x [B, h] (``p`` as in
    :func:`tspbench.core.layers.transformer_layer`, possibly sharded; cos/sin [1, d])."""
    B = x.shape[0]

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(B, -1, head_dim)

    a = rms_norm(x, p["attn_norm"], eps)
    q, k = rotate_qk(heads(in_proj(a, p, "wq")), heads(in_proj(a, p, "wk")), p, eps, cos, sin)
    o = hooks.attend(i, q, k, heads(in_proj(a, p, "wv"))).to(x.dtype)
    x = x + out_proj(o.flatten(1), p, "wo", hooks.exit)
    m = rms_norm(x, p["mlp_norm"], eps)
    return x + out_proj(F.silu(in_proj(m, p, "w1")) * in_proj(m, p, "w3"), p, "w2", hooks.exit)


def local_attend(cache: KVCache) -> Callable:
    """``attend`` of a cache that holds every token: append, attend over all of it."""

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache.write(i, k, v)
        return partial_attention(q, *cache.view(i))[0]

    return attend


def split_attend(cache: KVCache, merge: Callable) -> Callable:
    """``attend`` of a cache split by sequence: the owner appends, every rank attends over its
    slice, ``merge(o, lse)`` combines the partial outputs exactly."""

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if cache.mine:
            cache.write(i, k, v)
        return merge(*partial_attention(q, *cache.view(i)))

    return attend


def rope_at(cfg: ModelConfig, pos: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [1, d] of one position, dtype and device of ``like``."""
    cos, sin = rope_tables(torch.tensor([pos]), cfg, like.dtype)
    return cos.to(like.device), sin.to(like.device)


def run_layers(cfg: ModelConfig, layers: list[dict], x: torch.Tensor, cache: KVCache, hooks):
    """Every decode layer for the cache's next position, then advance the cache."""
    cos, sin = rope_at(cfg, cache.pos, x)
    for i, p in enumerate(layers):
        x = decode_layer(i, x, p, cfg.norm_eps, cfg.d_head, cos, sin, hooks)
    cache.advance()
    return x


# -- prefill of the plain layers ----------------------------------------------------------------
def prefill_layers(
    cfg: ModelConfig,
    layers: list[dict],
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    hooks: LayerHooks,
    cache: KVCache,
) -> torch.Tensor:
    """The reference layers over a (local) prompt x [B, n, h], each layer's local K/V (what its
    ``gather_kv`` hook receives) kept in the cache; returns the layers' output."""
    for i, p in enumerate(layers):

        def keep(k: torch.Tensor, v: torch.Tensor, i: int = i):
            cache.fill(i, k, v)
            return hooks.gather_kv(k, v)

        x = transformer_layer(
            x, p, cfg.norm_eps, cfg.d_head, cos, sin, replace(hooks, gather_kv=keep)
        )
    return x


# -- greedy choice --------------------------------------------------------------------------------
def named_layers(params: dict[str, torch.Tensor], cfg: ModelConfig) -> list[dict]:
    """Per layer, its reference-named parameters without the ``layers.i.`` prefix."""
    names = layer_params(cfg)
    return [{k: params[f"layers.{i}.{k}"] for k in names} for i in range(cfg.layers)]


def head_step(
    x: torch.Tensor, norm: torch.Tensor, head: torch.Tensor, eps: float, comm: Comm | None = None
) -> Step:
    """The final norm, the (vocabulary-split over ``comm``) head and the greedy choice."""
    return greedy((rms_norm(x, norm, eps) @ head.T).float(), comm)


def greedy(logits: torch.Tensor, comm: Comm | None = None) -> Step:
    """The arg max over the vocabulary of fp32 logits [B, V_local] (block ``comm.rank`` of a
    vocabulary split over ``comm``): one all-gather of [value, index] pairs, ties to the
    lowest id (as ``torch.argmax`` on whole logits)."""
    idx = logits.argmax(-1)
    if comm is None or comm.size == 1:
        return Step(idx, logits, comm)
    val = logits.gather(-1, idx[:, None])[:, 0]
    pair = torch.stack([val, (idx + comm.rank * logits.shape[-1]).float()], dim=-1)
    every = comm.all_gather(pair[None], dim=0)  # [D, B, 2]
    best = every[..., 0].argmax(0)  # the first (lowest) rank among equal maxima
    tokens = every[..., 1].gather(0, best[None])[0].long()
    return Step(tokens, logits, comm)


# -- closed-form events ---------------------------------------------------------------------------
PHASE = "decode"


def megatron_events(ev: costs.Schedule, spec: costs.Spec, T: int, axis: str) -> None:
    """Vocabulary-parallel embedding and two row-parallel outputs per layer: all-reduces of
    [B, h]; the greedy all-gather over the vocabulary split."""
    cfg, B, e = spec.cfg, spec.batch, spec.e
    ev.add(PHASE, axis, "all_reduce", T, B * cfg.hidden * e, times=2 * cfg.layers + 1)
    greedy_events(ev, spec, T, axis)


def greedy_events(
    ev: costs.Schedule, spec: costs.Spec, T: int, axis: str, phase: str = PHASE
) -> None:
    """The greedy pick over a vocabulary split T ways: each rank's best (value, index) per
    sequence, all-gathered."""
    ev.add(phase, axis, "all_gather", T, T * spec.batch * 2 * FP32)


def last_token_events(ev: costs.Schedule, spec: costs.Spec, P: int, axis: str) -> None:
    """A prefill over a sequence split P ways: the prompt's last position ends the zigzag
    chunk of the axis' rank 0, which broadcasts its [B, h] hidden state."""
    ev.add("forward", axis, "broadcast", P, spec.batch * spec.cfg.hidden * spec.e)


def merge_events(ev: costs.Schedule, spec: costs.Spec, P: int, heads: int, axis: str) -> None:
    """Split-K merge over P ranks of ``heads`` heads, all-reduced, per layer."""
    B, d = spec.batch, spec.cfg.d_head
    for _ in range(spec.cfg.layers):
        ev.add(PHASE, axis, "all_reduce", P, B * heads * FP32)
        ev.add(PHASE, axis, "all_reduce", P, B * heads * (d + 1) * FP32)


def bytes_per_step(ev: costs.Schedule) -> dict[str, float]:
    """Per-rank bytes of a decode schedule by collective kind (the counter's rule)."""
    from tspbench.core.comm import bus_bytes

    out: dict[str, float] = {}
    for _, _, kind, size, nbytes in ev:
        out[kind] = out.get(kind, 0.0) + bus_bytes(kind, nbytes, size)
    return {k: b for k, b in out.items() if b}
