"""SP (context parallelism): weights replicated, tokens zigzag over D ranks.

Each rank projects its own tokens; K/V are all-gathered along the sequence (reduce-scattered in
backward) for zigzag causal attention, through the same attention entry point as TSP; or, with
``cp_comm=a2a`` (DeepSpeed-Ulysses), Q, K/V and the output are re-sharded between sequence and
heads by all-to-alls around causal attention over the whole sequence. Every other op is
token-local. Gradients of the replicated weights are summed with one all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baselines.sp.costs import SPCosts
from baselines.sp.decode import SPDecoder
from tspbench.core import zigzag
from tspbench.core.config import ModelConfig
from tspbench.core.context_parallel import (
    SequenceSharded,
    cp_tables,
    exchange_groups,
)
from tspbench.core.layers import rms_norm, transformer_layer
from tspbench.core.mesh import Axis, Mesh
from tspbench.core.optim import grad_sq_sum
from tspbench.core.options import CP_A2A, CP_COMM, OVERLAP, Value
from tspbench.core.reference import head_name, layer_params, param_shapes
from tspbench.core.strategy import Batch, tensor_of


class SP(SequenceSharded):
    name = "sp"
    display = "SP"  # legends, titles and tables' captions
    options = (CP_COMM, OVERLAP, CP_A2A)  # overlap: the ring's hops behind the attention
    cp_comm: str  # set from the options (Strategy.__init__)
    overlap: bool
    cp_a2a: int
    costs = SPCosts()
    decoder = SPDecoder
    stages = True
    zero_bubble = True

    @classmethod
    def checked_options(cls) -> list[dict[str, Value]]:
        """Each exchange, and the ring with its hops waited for at once (overlap touches only
        the ring, so overlap off alone would repeat the default)."""
        return [{"cp_comm": c} for c in CP_COMM.choices if c != CP_COMM.default] + [
            {"cp_comm": "ring", "overlap": False}
        ]

    def __init__(self, cfg: ModelConfig, mesh: Mesh, **kw) -> None:
        super().__init__(cfg, mesh, **kw)
        self.comm = mesh[Axis.MODEL]
        self.cp_groups = exchange_groups(mesh, Axis.MODEL, cfg, self.cp_comm, self.cp_a2a)
        held = filter(self.stage.holds, param_shapes(cfg))  # (a pipeline stage: its part)
        self.params = {n: self.to_param(self.init_block(n)) for n in held}

    def shard_batch(self, tokens: torch.Tensor, labels: torch.Tensor) -> Batch:
        return self.zigzag_batch(tokens, labels, self.comm)

    def hidden_local(self, batch: Batch) -> torch.Tensor:
        x = self.run_layers(self.embed(batch.tokens))
        return rms_norm(x, self.params["norm"], self.cfg.norm_eps)

    def tied_table(self) -> list[torch.nn.Parameter]:
        return [self.params["embed"]]  # (the first stage's, or the last stage's copy)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.params["embed"])

    def run_layers(self, x: torch.Tensor) -> torch.Tensor:
        cfg, p = self.cfg, self.params
        S = x.shape[1] * self.comm.size
        cos, sin, hooks = cp_tables(
            self, S, self.comm, cfg, x, self.cp_comm, self.overlap, self.cp_groups
        )
        for i in self.stage.layers:
            lp = {k: p[f"layers.{i}.{k}"] for k in layer_params(cfg)}
            x = self.checkpointed(
                transformer_layer, x, lp, cfg.norm_eps, cfg.d_head, cos, sin, hooks
            )
        return x

    def head_loss(self, x: torch.Tensor, labels: torch.Tensor, n_tokens: int) -> torch.Tensor:
        h = rms_norm(x, self.params["norm"], self.cfg.norm_eps)
        logits = (h @ self.params[head_name(self.cfg)].T).float()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / n_tokens

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.run_layers(self.embed(batch.tokens))
        local = self.head_loss(x, batch.labels, batch.n_tokens)
        return local, self.reported_loss(local)

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
        return {n: tensor_of(p, grads) for n, p in self.params.items()}
