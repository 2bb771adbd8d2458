"""SP's decode path (docs/decode.md): weights replicated, the cache split by sequence; each
step's attention merged over the D ranks. The prefill exchanges by the run's ``cp_comm``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tspbench.core import costs, zigzag
from tspbench.core.config import ModelConfig
from tspbench.core.context_parallel import cp_tables
from tspbench.core.decode import (
    DecodeHooks,
    Decoder,
    head_step,
    last_token_events,
    merge_events,
    named_layers,
    prefill_layers,
    run_layers,
    split_attend,
)
from tspbench.core.kvcache import KVCache, Step, merge_all
from tspbench.core.mesh import Axis
from tspbench.core.reference import head_name
from tspbench.core.strategy import Layout


class SPDecoder(Decoder):
    @classmethod
    def validate(
        cls, strategy, cfg: ModelConfig, layout: Layout, prompt_len: int, new_tokens: int,
        batch: int, **options,
    ) -> None:  # fmt: skip
        super().validate(strategy, cfg, layout, prompt_len, new_tokens, batch)
        strategy.validate(cfg, layout, prompt_len, batch, **options)

    @classmethod
    def cache_split(cls, layout: Layout) -> tuple[int, int]:
        return layout.degree, 1

    @classmethod
    def schedule(cls, spec: costs.Spec) -> costs.Schedule:
        ev = costs.Schedule()
        merge_events(ev, spec, spec.degree, spec.cfg.heads, Axis.MODEL)
        return ev

    @classmethod
    def prefill_schedule(cls, spec: costs.Spec) -> costs.Schedule:
        ev = costs.context_parallel(spec, Axis.MODEL, spec.degree)  # its loss is local
        last_token_events(ev, spec, spec.degree, Axis.MODEL)
        return ev  # (every rank holds the LM head: the pick is local)

    def _layers(self) -> list[dict]:
        return named_layers(self.model.params, self.model.cfg)

    def _step(self, x: torch.Tensor) -> Step:
        p = self.model.params
        return head_step(x, p["norm"], p[head_name(self.model.cfg)], self.model.cfg.norm_eps)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, max_len: int) -> tuple[KVCache, Step]:
        m, (B, P) = self.model, tokens.shape
        cfg, comm = m.cfg, m.comm
        D, r = comm.size, comm.rank
        x = F.embedding(zigzag.shard(tokens, D, r).to(m.device), m.params["embed"])
        slots = KVCache.capacity(P, max_len, D)
        cache = KVCache.empty(cfg.layers, B, cfg.kv_heads, slots, cfg.d_head, x, D, r)
        cos, sin, hooks = cp_tables(
            m, P, comm, cfg, x, m.cp_comm, groups=m.cp_groups
        )  # the prefill exchanges
        # as training does (cp_comm); the cache keeps each rank's own tokens' K/V either way
        x = prefill_layers(cfg, self._layers(), x, cos, sin, hooks, cache)
        cache.start(P // D, P)
        last = x[:, -1].contiguous()  # position P-1 ends chunk 2D-1: rank 0's last local token
        return cache, self._step(comm.broadcast(last, src=0))

    @torch.no_grad()
    def decode_step(self, cache: KVCache, tokens: torch.Tensor) -> Step:
        m = self.model
        x = F.embedding(tokens.to(m.device), m.params["embed"])
        hooks = DecodeHooks(split_attend(cache, lambda o, lse: merge_all(o, lse, m.comm)))
        return self._step(run_layers(m.cfg, self._layers(), x, cache, hooks))
