"""TP+SP's decode path (docs/decode.md): Megatron over T, the cache split by sequence over
Sigma; each step's attention merged over Sigma. The prefill exchanges by the run's ``cp_comm``."""

from __future__ import annotations

import torch

from tspbench.core import costs, zigzag
from tspbench.core.collectives import reduce_from
from tspbench.core.config import ConfigError, ModelConfig
from tspbench.core.context_parallel import cp_tables
from tspbench.core.decode import (
    DecodeHooks,
    Decoder,
    check_kv_split,
    greedy_events,
    head_step,
    kv_heads_local,
    last_token_events,
    megatron_events,
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
from tspbench.core.vocab_parallel import embedding


class TPSPDecoder(Decoder):
    @classmethod
    def validate(
        cls, strategy, cfg: ModelConfig, layout: Layout, prompt_len: int, new_tokens: int,
        batch: int, **options,
    ) -> None:  # fmt: skip
        super().validate(strategy, cfg, layout, prompt_len, new_tokens, batch)
        if layout.tp * layout.sp != layout.degree:
            raise ConfigError(
                f"tp={layout.tp} x sp={layout.sp} = {layout.tp * layout.sp}: must equal "
                f"degree={layout.degree} (T x Sigma = D)"
            )
        for field in ("heads", "ffn", "vocab"):
            strategy.require_divisible(f"model.{field}", getattr(cfg, field), layout.tp, "T (tp)")
        check_kv_split(cfg, layout.tp, "T (tp)")
        zigzag.check_divisible(prompt_len, layout.sp)

    @classmethod
    def cache_split(cls, layout: Layout) -> tuple[int, int]:
        return layout.sp, layout.tp

    @classmethod
    def schedule(cls, spec: costs.Spec) -> costs.Schedule:
        ev = costs.Schedule()
        megatron_events(ev, spec, spec.tp, Axis.TP)
        merge_events(ev, spec, spec.sp, spec.cfg.heads // spec.tp, Axis.SP)
        return ev

    @classmethod
    def prefill_schedule(cls, spec: costs.Spec) -> costs.Schedule:
        ev = costs.megatron(spec, spec.tp, Axis.TP, Axis.SP, spec.sp, loss=False)
        last_token_events(ev, spec, spec.sp, Axis.SP)
        greedy_events(ev, spec, spec.tp, Axis.TP, "forward")
        return ev

    def _layers(self) -> list[dict]:
        return named_layers(self.model.params, self.model.cfg)

    def _step(self, x: torch.Tensor) -> Step:
        m = self.model
        return head_step(x, m.params["norm"], m.params[head_name(m.cfg)], m.cfg.norm_eps, m.tp)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, max_len: int) -> tuple[KVCache, Step]:
        m, (B, P) = self.model, tokens.shape
        cfg, sp, tp = m.cfg, m.sp, m.tp
        local = zigzag.shard(tokens, sp.size, sp.rank).to(m.device)
        x = embedding(local, m.params["embed"], tp)
        slots = KVCache.capacity(P, max_len, sp.size)
        heads = kv_heads_local(cfg.kv_heads, tp.size)
        cache = KVCache.empty(cfg.layers, B, heads, slots, cfg.d_head, x, sp.size, sp.rank)
        # the prefill exchanges over Sigma as training does (cp_comm); the cache keeps each
        # rank's own tokens' K/V either way
        cos, sin, hooks = cp_tables(
            m, P, sp, cfg, x, m.cp_comm, groups=m.cp_groups, exit=lambda t: reduce_from(t, tp)
        )
        x = prefill_layers(cfg, self._layers(), x, cos, sin, hooks, cache)
        cache.start(P // sp.size, P)
        last = x[:, -1].contiguous()  # position P-1 ends chunk 2 Sigma - 1: sp rank 0's last
        return cache, self._step(sp.broadcast(last, src=0))

    @torch.no_grad()
    def decode_step(self, cache: KVCache, tokens: torch.Tensor) -> Step:
        m = self.model
        x = embedding(tokens.to(m.device), m.params["embed"], m.tp)
        hooks = DecodeHooks(
            split_attend(cache, lambda o, lse: merge_all(o, lse, m.sp)),
            exit=lambda t: reduce_from(t, m.tp),
        )
        return self._step(run_layers(m.cfg, self._layers(), x, cache, hooks))
