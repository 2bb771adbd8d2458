"""The reference's decode path (docs/decode.md): the reference model with a KV cache, on one
rank."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tspbench.core import costs
from tspbench.core.decode import (
    DecodeHooks,
    Decoder,
    head_step,
    local_attend,
    prefill_layers,
    run_layers,
)
from tspbench.core.kvcache import KVCache, Step
from tspbench.core.layers import cached, rope_on
from tspbench.core.reference import layer_params
from tspbench.core.strategy import Layout


class SingleDecoder(Decoder):
    @classmethod
    def cache_split(cls, layout: Layout) -> tuple[int, int]:
        return 1, 1  # one rank holds the whole cache

    @classmethod
    def schedule(cls, spec: costs.Spec) -> costs.Schedule:
        return costs.Schedule()

    @classmethod
    def prefill_schedule(cls, spec: costs.Spec) -> costs.Schedule:
        return costs.Schedule()

    def _layers(self) -> list[dict]:
        model, n = self.model.model, self.model.cfg.layers
        return [{k: model.p(f"layers.{i}.{k}") for k in layer_params(model.cfg)} for i in range(n)]

    def _step(self, x: torch.Tensor) -> Step:
        model, eps = self.model.model, self.model.cfg.norm_eps
        return head_step(x, model.p("norm"), model.head(), eps)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, max_len: int) -> tuple[KVCache, Step]:
        m, (B, P) = self.model, tokens.shape
        cfg = m.cfg
        x = F.embedding(tokens.to(m.device), m.model.p("embed"))
        cache = KVCache.empty(cfg.layers, B, cfg.kv_heads, max_len, cfg.d_head, x)
        cos, sin = cached(m, ("rope", P, x.dtype), lambda: rope_on(torch.arange(P), cfg, x))
        x = prefill_layers(cfg, self._layers(), x, cos, sin, m.hooks, cache)
        cache.start(P, P)
        return cache, self._step(x[:, -1])

    @torch.no_grad()
    def decode_step(self, cache: KVCache, tokens: torch.Tensor) -> Step:
        m = self.model
        x = F.embedding(tokens.to(m.device), m.model.p("embed"))
        hooks = DecodeHooks(local_attend(cache))
        return self._step(run_layers(m.cfg, self._layers(), x, cache, hooks))
