"""TP: Megatron tensor parallelism over D ranks.

Wq/Wk/Wv/W1/W3 are column-parallel (rows split), Wo/W2 row-parallel (columns split), each
followed by an all-reduce of the [B, S, h] output; embedding and LM head are vocab-parallel
(masked lookup + all-reduce; cross-entropy from all-reduced max, sum-exp and target logit).
Activations are replicated on every rank of the group: that is what TSP is compared against.
"""

from __future__ import annotations

import torch

from baselines.tp.costs import TPCosts
from baselines.tp.decode import TPDecoder
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

    @classmethod
    def validate(cls, cfg: ModelConfig, layout: Layout, seq_len: int, batch: int, **_) -> None:
        super().validate(cfg, layout, seq_len, batch)
        for field in ("heads", "kv_heads", "ffn", "vocab"):
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

    def head_loss(self, x: torch.Tensor, labels: torch.Tensor, n_tokens: int) -> torch.Tensor:
        h = rms_norm(x, self.params["norm"], self.cfg.norm_eps)
        head = self.params[head_name(self.cfg)]
        return cross_entropy_sum(h, head, labels, self.comm) / n_tokens

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.run_layers(self.embed(batch.tokens))
        local = self.head_loss(x, batch.labels, batch.n_tokens)
        return local, self.reported_loss(local)

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
