"""TP's decode path (docs/decode.md): heads split over the D ranks (KV heads replicated when
fewer than T), every rank holding the whole sequence's cache of its heads."""

from __future__ import annotations

import torch

from tspbench.core import costs
from tspbench.core.collectives import reduce_from
from tspbench.core.config import ModelConfig
from tspbench.core.decode import (
    DecodeHooks,
    Decoder,
    check_kv_split,
    greedy_events,
    head_step,
    kv_heads_local,
    local_attend,
    megatron_events,
    named_layers,
    prefill_layers,
    run_layers,
)
from tspbench.core.kvcache import KVCache, Step
from tspbench.core.layers import cached, rope_on
from tspbench.core.mesh import Axis
from tspbench.core.reference import head_name
from tspbench.core.strategy import Layout
from tspbench.core.vocab_parallel import embedding


class TPDecoder(Decoder):
    @classmethod
    def validate(
        cls, strategy, cfg: ModelConfig, layout: Layout, prompt_len: int, new_tokens: int,
        batch: int, **_,
    ) -> None:  # fmt: skip
        super().validate(strategy, cfg, layout, prompt_len, new_tokens, batch)
        for field in ("heads", "ffn", "vocab"):
            strategy.require_divisible(f"model.{field}", getattr(cfg, field), layout.degree, "T")
        check_kv_split(cfg, layout.degree)

    @classmethod
    def cache_split(cls, layout: Layout) -> tuple[int, int]:
        return 1, layout.degree

    @classmethod
    def schedule(cls, spec: costs.Spec) -> costs.Schedule:
        ev = costs.Schedule()
        megatron_events(ev, spec, spec.degree, Axis.MODEL)
        return ev

    @classmethod
    def prefill_schedule(cls, spec: costs.Spec) -> costs.Schedule:
        ev = costs.megatron(spec, spec.degree, Axis.MODEL, loss=False)
        greedy_events(ev, spec, spec.degree, Axis.MODEL, "forward")
        return ev

    def _layers(self) -> list[dict]:
        return named_layers(self.model.params, self.model.cfg)

    def _step(self, x: torch.Tensor) -> Step:
        m = self.model
        return head_step(x, m.params["norm"], m.params[head_name(m.cfg)], m.cfg.norm_eps, m.comm)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, max_len: int) -> tuple[KVCache, Step]:
        m, (B, P) = self.model, tokens.shape
        cfg = m.cfg
        x = embedding(tokens.to(m.device), m.params["embed"], m.comm)
        heads = kv_heads_local(cfg.kv_heads, m.comm.size)
        cache = KVCache.empty(cfg.layers, B, heads, max_len, cfg.d_head, x)
        cos, sin = cached(m, ("rope", P, x.dtype), lambda: rope_on(torch.arange(P), cfg, x))
        x = prefill_layers(cfg, self._layers(), x, cos, sin, m.hooks, cache)
        cache.start(P, P)
        return cache, self._step(x[:, -1])

    @torch.no_grad()
    def decode_step(self, cache: KVCache, tokens: torch.Tensor) -> Step:
        m = self.model
        x = embedding(tokens.to(m.device), m.params["embed"], m.comm)
        hooks = DecodeHooks(local_attend(cache), exit=lambda t: reduce_from(t, m.comm))
        return self._step(run_layers(m.cfg, self._layers(), x, cache, hooks))
