"""TP: Megatron tensor parallelism over D ranks.

Wq/Wk/Wv/W1/W3 are column-parallel (rows split), Wo/W2 row-parallel (columns split), each
followed by an all-reduce of the [B, S, h] output; embedding and LM head are vocab-parallel
(masked lookup + all-reduce; cross-entropy from all-reduced max, sum-exp and target logit).
Activations are replicated on every rank of the group: that is what TSP is compared against.

With experts (Megatron-Core's MoE with expert parallelism over the TP group, expert tensor
parallelism 1, sequence parallelism off, its all-gather token dispatcher): rank r owns E/T whole
experts; the tokens are already on every rank, so each rank routes all of them (the router
whole), applies its own experts to those routed there and the partial outputs are summed by the
layer's all-reduce, as a row-parallel output's. Each rank's router gradient covers its experts'
tokens only and is summed after backward.
"""

from __future__ import annotations

import torch

from baselines.tp.costs import TPCosts
from baselines.tp.decode import TPDecoder
from tspbench.core import moe
from tspbench.core.attention import attention
from tspbench.core.collectives import copy_to, reduce_from
from tspbench.core.config import ModelConfig
from tspbench.core.decode import megatron_block
from tspbench.core.layers import LayerHooks, cached, rms_norm, rope_on, transformer_layer
from tspbench.core.megatron import gather_named, head_partial, shard_dim
from tspbench.core.mesh import Axis, Mesh
from tspbench.core.optim import grad_sq_sum
from tspbench.core.reference import head_name, layer_params, param_shapes
from tspbench.core.strategy import Batch, Layout, Strategy
from tspbench.core.vocab_parallel import cross_entropy_sum, embedding


class TP(Strategy):
    name = "tp"
    display = "TP"  # legends, titles and tables' captions
    costs = TPCosts()
    decoder = TPDecoder
    stages = True
    zero_bubble = True
    experts = True

    @classmethod
    def validate(cls, cfg: ModelConfig, layout: Layout, seq_len: int, batch: int, **_) -> None:
        super().validate(cfg, layout, seq_len, batch)
        mlp = ("ffn",) if not cfg.moe else ("experts", "shared_ffn")  # E/T experts each
        for field in ("heads", "kv_heads", *mlp, "vocab"):
            cls.require_divisible(f"model.{field}", getattr(cfg, field), layout.degree, "T")

    def __init__(self, cfg: ModelConfig, mesh: Mesh, **kw) -> None:
        super().__init__(cfg, mesh, **kw)
        self.comm = mesh[Axis.MODEL]
        T, r = self.comm.size, self.comm.rank
        self.params: dict[str, torch.nn.Parameter] = {}
        for name in filter(self.stage.holds, param_shapes(cfg)):  # (a pipeline stage: its part)
            rows, cols = megatron_block(cfg, name, T, r, shard_dim(name))
            self.params[name] = self.to_param(self.init_block(name, rows, cols))
        self.hooks = LayerHooks(
            enter=lambda t: copy_to(t, self.comm),
            exit=lambda t: reduce_from(t, self.comm),
            attn=attention,
            moe=self.moe_block,
        )

    def shard_batch(self, tokens: torch.Tensor, labels: torch.Tensor) -> Batch:
        return Batch(
            self.dp_slice(tokens).to(self.device),
            self.dp_slice(labels).to(self.device),
            tokens.numel(),
        )

    def hidden_local(self, batch: Batch) -> torch.Tensor:
        x = self.run_layers(self.embed(batch.tokens))
        return rms_norm(x, self.params["norm"], self.cfg.norm_eps)

    def tied_table(self) -> list[torch.nn.Parameter]:
        return [self.params["embed"]]  # (the first stage's, or the last stage's copy)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return embedding(tokens, self.params["embed"], self.comm)

    def run_layers(self, x: torch.Tensor) -> torch.Tensor:
        cfg, p, L = self.cfg, self.params, x.shape[1]
        cos, sin = cached(self, ("rope", L, x.dtype), lambda: rope_on(torch.arange(L), cfg, x))
        for i in self.stage.layers:
            lp = {k: p[f"layers.{i}.{k}"] for k in layer_params(cfg)}
            x = self.checkpointed(
                transformer_layer, x, lp, cfg.norm_eps, cfg.d_head, cos, sin, self.hooks
            )
        return x

    def moe_block(self, m: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
        """The mixture of experts on the replicated tokens: every rank routes them all, applies
        its E/T experts (and its slice of a shared expert) to those routed there; the
        all-reduce sums the partial outputs (backward: the inputs' gradients summed on entry)."""
        cfg, T, r = self.cfg, self.comm.size, self.comm.rank
        m = copy_to(m, self.comm)
        m2 = m.reshape(-1, m.shape[-1])
        _, weights, idx = moe.route(m2, p["router"], cfg.top_k, cfg.norm_topk, self.router_stats)
        y = moe.routed_experts(m2, weights, idx, p, r * cfg.experts // T, cfg.experts)
        if "sgate" in p:  # its column- and row-parallel slices: a partial output, as the MLP's
            y = y + moe.shared_expert(m2, p)
        return reduce_from(y, self.comm).view(m.shape)

    def head_loss(self, x: torch.Tensor, labels: torch.Tensor, n_tokens: int) -> torch.Tensor:
        h = rms_norm(x, self.params["norm"], self.cfg.norm_eps)
        head = self.params[head_name(self.cfg)]
        return cross_entropy_sum(h, head, labels, self.comm) / n_tokens

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        self.router_stats = moe.RouterStats() if self.cfg.moe else None
        x = self.run_layers(self.embed(batch.tokens))
        local = self.head_loss(x, batch.labels, batch.n_tokens)
        reported = local
        if self.router_stats is not None:  # every rank routed every token: its counts are the
            # group's; each backpropagates 1/T of the load-balancing loss, whose gradients the
            # router's all-reduce and the inputs' (on entry) sum back to one
            aux = self.routing_done(self.router_stats, token_axes=())
            reported, local = local + aux, local + aux / self.comm.size
            if self.comm.rank and self.routed is not None:  # the record's tokens per
                self.routed.zero_()  # expert: one rank's count of them
        self.router_stats = None
        return local, self.reported_loss(reported)

    def routing_counted(self, stats: moe.RouterStats) -> None:
        super().routing_counted(stats)
        if self.comm.rank and self.routed is not None:  # every rank routed every token: one
            self.routed.zero_()  # rank's count of them

    def reported_loss(self, local: torch.Tensor) -> torch.Tensor:
        return self.total_loss(local, token_axes=())  # every rank holds the whole loss

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.params.values())

    def finish_grads(self) -> None:
        super().finish_grads()
        self.all_reduce_grads(head_partial(self.params), self.comm)

    def grad_sq_norm(self) -> torch.Tensor:
        sharded = [p for n, p in self.params.items() if shard_dim(n) is not None]
        replicated = [p for n, p in self.params.items() if shard_dim(n) is None]
        return self.comm.all_reduce_metric(grad_sq_sum(sharded)) + grad_sq_sum(replicated)

    def hidden(self, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            return self.hidden_local(batch)

    def full_params(self, grads: bool = False) -> dict[str, torch.Tensor]:
        return gather_named(self.params, self.comm, grads)
