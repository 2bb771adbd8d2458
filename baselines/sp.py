"""SP (context parallelism): weights replicated, tokens zigzag over D ranks.

Each rank projects its own tokens; K/V are all-gathered along the sequence (reduce-scattered in
backward) for zigzag causal attention, through the same attention entry point as TSP. Every
other op is token-local. Gradients of the replicated weights are summed with one all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tspbench.core import costs, zigzag
from tspbench.core.config import ModelConfig
from tspbench.core.context_parallel import cp_tables
from tspbench.core.decode import (
    DecodeHooks,
    head_step,
    merge_events,
    named_layers,
    prefill_layers,
    run_layers,
    split_attend,
)
from tspbench.core.kvcache import KVCache, Step, merge_all
from tspbench.core.layers import rms_norm, transformer_layer
from tspbench.core.mesh import Axis, Mesh
from tspbench.core.optim import grad_sq_sum
from tspbench.core.reference import LAYER_PARAMS, param_shapes
from tspbench.core.strategy import Batch, Layout, Strategy


class SP(Strategy):
    name = "sp"
    display = "SP"  # legends, titles and tables' captions

    @classmethod
    def context_parallel(cls, layout: Layout) -> int:
        return layout.degree

    grad_staging_copies = 1  # finish_grads packs every gradient into one all-reduce

    @classmethod
    def schedule(cls, spec: costs.Spec) -> costs.Schedule:
        """Context parallelism's K/V gathers; one all-reduce of every gradient after backward."""
        ev = costs.context_parallel(spec, Axis.MODEL, spec.degree)
        n = cls.param_numel(spec.cfg, spec.layout)
        costs.grads_all_reduce(ev, spec, Axis.MODEL, spec.degree, n)
        return ev

    @classmethod
    def metric_reductions(cls, layout: Layout, train: bool) -> tuple[int, int]:
        return layout.degree, 1  # the loss is summed over the sequence's chunks

    @classmethod
    def validate(cls, cfg: ModelConfig, layout: Layout, seq_len: int, batch: int, **_) -> None:
        super().validate(cfg, layout, seq_len, batch)
        zigzag.check_divisible(seq_len, layout.degree)

    def __init__(self, cfg: ModelConfig, mesh: Mesh, **kw) -> None:
        super().__init__(cfg, mesh, **kw)
        self.comm = mesh[Axis.MODEL]
        self.params = {n: self.to_param(self.init_block(n)) for n in param_shapes(cfg)}

    def shard_batch(self, tokens: torch.Tensor, labels: torch.Tensor) -> Batch:
        return self.zigzag_batch(tokens, labels, self.comm)

    def hidden_local(self, batch: Batch) -> torch.Tensor:
        cfg, p = self.cfg, self.params
        S = batch.tokens.shape[1] * self.comm.size
        x = F.embedding(batch.tokens, p["embed"])
        cos, sin, hooks = cp_tables(self, S, self.comm, cfg, x)
        for i in range(cfg.layers):
            lp = {k: p[f"layers.{i}.{k}"] for k in LAYER_PARAMS}
            x = self.checkpointed(
                transformer_layer, x, lp, cfg.norm_eps, cfg.head_dim, cos, sin, hooks
            )
        return rms_norm(x, p["norm"], cfg.norm_eps)

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = (self.hidden_local(batch) @ self.params["head"].T).float()
        ce = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="sum")
        local = ce / batch.n_tokens
        return local, self.total_loss(local)

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.params.values())

    def finish_grads(self) -> None:
        super().finish_grads()
        self.all_reduce_grads(self.parameters(), self.comm)

    def grad_sq_norm(self) -> torch.Tensor:
        return grad_sq_sum(self.parameters())

    def hidden(self, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            h = self.hidden_local(batch)
        return zigzag.unshard(list(self.comm.all_gather(h, dim=1).chunk(self.comm.size, dim=1)))

    def full_params(self, grads: bool = False) -> dict[str, torch.Tensor]:
        return {n: (p.grad if grads else p).detach() for n, p in self.params.items()}

    # -- decode (docs/decode.md): weights replicated, the cache split by sequence --------------
    decodes = True

    @classmethod
    def validate_decode(
        cls, cfg: ModelConfig, layout: Layout, prompt_len: int, new_tokens: int, batch: int, **_
    ) -> None:
        super().validate_decode(cfg, layout, prompt_len, new_tokens, batch)
        cls.validate(cfg, layout, prompt_len, batch)

    @classmethod
    def decode_cache_split(cls, layout: Layout) -> tuple[int, int]:
        return layout.degree, 1

    @classmethod
    def decode_schedule(cls, spec: costs.Spec) -> costs.Schedule:
        ev = costs.Schedule()
        merge_events(ev, spec, spec.degree, spec.cfg.heads, Axis.MODEL)
        return ev

    def _layers(self) -> list[dict]:
        return named_layers(self.params, self.cfg.layers)

    def _step(self, x: torch.Tensor) -> Step:
        p = self.params
        return head_step(x, p["norm"], p["head"], self.cfg.norm_eps)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, max_len: int) -> tuple[KVCache, Step]:
        cfg, comm, (B, P) = self.cfg, self.comm, tokens.shape
        D, r = comm.size, comm.rank
        x = F.embedding(zigzag.shard(tokens, D, r).to(self.device), self.params["embed"])
        slots = KVCache.capacity(P, max_len, D)
        cache = KVCache.empty(cfg.layers, B, cfg.kv_heads, slots, cfg.head_dim, x, D, r)
        cos, sin, hooks = cp_tables(self, P, comm, cfg, x)
        x = prefill_layers(cfg, self._layers(), x, cos, sin, hooks, cache)
        cache.start(P // D, P)
        last = x[:, -1].contiguous()  # position P-1 ends chunk 2D-1: rank 0's last local token
        return cache, self._step(comm.broadcast(last, src=0))

    @torch.no_grad()
    def decode_step(self, cache: KVCache, tokens: torch.Tensor) -> Step:
        x = F.embedding(tokens.to(self.device), self.params["embed"])
        hooks = DecodeHooks(split_attend(cache, lambda o, lse: merge_all(o, lse, self.comm)))
        return self._step(run_layers(self.cfg, self._layers(), x, cache, hooks))
