"""TP+SP: a 2-D mesh of T x Sigma = D ranks, Megatron TP inside (contiguous ranks), context
parallelism across.

Weights are split over the T ranks of a TP group as in Megatron and replicated over the Sigma
groups; tokens are split zigzag over Sigma and replicated inside a TP group. Attention exchanges
the group's local heads over Sigma by ``cp_comm``, as SP does over D: K/V all-gathered (the
default), the Ulysses all-to-alls (``a2a``: H/T and kv heads/T split again over Sigma), or the
ring (``ring``: Megatron-Core's TP + CP ``p2p``, its long-context default); projections
all-reduce over T. Gradients are summed over Sigma after backward. Every factorisation
T x Sigma of D is a separate configuration.
"""

from __future__ import annotations

import torch

from baselines.tpsp.costs import TPSPCosts
from baselines.tpsp.decode import TPSPDecoder
from tspbench.core import zigzag
from tspbench.core.collectives import copy_to, reduce_from
from tspbench.core.config import ConfigError, ModelConfig
from tspbench.core.context_parallel import (
    cp_tables,
    exchange_groups,
)
from tspbench.core.costs import Spec
from tspbench.core.decode import megatron_block
from tspbench.core.exchange import check_exchange, searched_exchange
from tspbench.core.layers import rms_norm, transformer_layer
from tspbench.core.megatron import gather_named, head_partial, shard_dim
from tspbench.core.mesh import Axis, Mesh
from tspbench.core.optim import grad_sq_sum
from tspbench.core.options import CP_A2A, CP_COMM, Value
from tspbench.core.reference import head_name, layer_params, param_shapes
from tspbench.core.strategy import Batch, Layout, Strategy
from tspbench.core.vocab_parallel import cross_entropy_sum, embedding


class TPSP(Strategy):
    name = "tpsp"
    display = "TP+SP"  # legends, titles and tables' captions
    costs = TPSPCosts()
    decoder = TPSPDecoder
    factored = True
    stages = True
    zero_bubble = True
    options = (CP_COMM, CP_A2A)  # over Sigma; the ring's hops always behind the attention
    cp_comm: str
    cp_a2a: int

    @classmethod
    def make_layout(cls, degree: int | None, tp: int, sp: int, dp: int) -> Layout:
        return Layout(degree=tp * sp if degree is None else degree, tp=tp, sp=sp, dp=dp)

    @classmethod
    def sweep_layouts(cls, degrees: list[int], factors: list[list[int]]) -> list[Layout]:
        return [Layout(degree=t * s, tp=t, sp=s) for t, s in factors if t * s in degrees]

    @classmethod
    def factors(cls, layout: Layout) -> dict[str, int | None]:
        return {"tp": layout.tp, "sp": layout.sp}

    @classmethod
    def checked_layouts(cls) -> list[Layout]:
        return [Layout(degree=2, tp=2, sp=1), Layout(degree=2, tp=1, sp=2), Layout(4, tp=2, sp=2)]

    @classmethod
    def tag(cls, layout: Layout) -> str:
        return f"{cls.name}-{layout.tp}x{layout.sp}"

    @classmethod
    def label(cls, layout: Layout) -> str:
        return f"{cls.name} ({layout.tp}x{layout.sp})"

    @classmethod
    def context_parallel(cls, layout: Layout) -> int:
        return layout.sp

    @classmethod
    def searched_values(cls, spec: Spec | None) -> dict[str, tuple[Value, ...]]:
        """Each exchange where it changes the run: over Sigma = 1 the three are one run, and a
        decode prefills by all-gather only."""
        out = super().searched_values(spec)
        if spec is None:
            return out
        out = searched_exchange(out, spec.cfg, spec.cp, spec.tp)
        if spec.cp == 1 or getattr(spec, "decoding", False):
            out[CP_COMM.name] = (CP_COMM.default,)
        return out

    @classmethod
    def mesh_dims(cls, layout: Layout) -> dict[str, int]:
        return {Axis.DP: layout.dp, Axis.SP: layout.sp, Axis.TP: layout.tp}

    @classmethod
    def validate(
        cls, cfg: ModelConfig, layout: Layout, seq_len: int, batch: int, **options: Value
    ) -> None:
        super().validate(cfg, layout, seq_len, batch)
        if layout.tp * layout.sp != layout.degree:
            raise ConfigError(
                f"tp={layout.tp} x sp={layout.sp} = {layout.tp * layout.sp}: must equal "
                f"degree={layout.degree} (T x Sigma = D)"
            )
        for field in ("heads", "kv_heads", "ffn", "vocab"):
            cls.require_divisible(f"model.{field}", getattr(cfg, field), layout.tp, "T (tp)")
        cp_comm, cp_a2a = options.get("cp_comm"), options.get("cp_a2a", 0)
        check_exchange(cfg, seq_len, layout.sp, cp_comm, layout.tp, cp_a2a)

    def __init__(self, cfg: ModelConfig, mesh: Mesh, **kw) -> None:
        super().__init__(cfg, mesh, **kw)
        self.tp, self.sp = mesh[Axis.TP], mesh[Axis.SP]
        T, r = self.tp.size, self.tp.rank
        self.cp_groups = exchange_groups(mesh, Axis.SP, cfg, self.cp_comm, self.cp_a2a, T)
        self.params: dict[str, torch.nn.Parameter] = {}
        for name in filter(self.stage.holds, param_shapes(cfg)):  # (a pipeline stage: its part)
            rows, cols = megatron_block(cfg, name, T, r, shard_dim(name))
            self.params[name] = self.to_param(self.init_block(name, rows, cols))

    def shard_batch(self, tokens: torch.Tensor, labels: torch.Tensor) -> Batch:
        return self.zigzag_batch(tokens, labels, self.sp)

    def hidden_local(self, batch: Batch) -> torch.Tensor:
        x = self.run_layers(self.embed(batch.tokens))
        return rms_norm(x, self.params["norm"], self.cfg.norm_eps)

    def tied_table(self) -> list[torch.nn.Parameter]:
        return [self.params["embed"]]  # (the first stage's, or the last stage's copy)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return embedding(tokens, self.params["embed"], self.tp)

    def run_layers(self, x: torch.Tensor) -> torch.Tensor:
        cfg, p = self.cfg, self.params
        S = x.shape[1] * self.sp.size
        cos, sin, hooks = cp_tables(
            self, S, self.sp, cfg, x, self.cp_comm, groups=self.cp_groups,
            enter=lambda t: copy_to(t, self.tp), exit=lambda t: reduce_from(t, self.tp),
        )  # fmt: skip
        for i in self.stage.layers:
            lp = {k: p[f"layers.{i}.{k}"] for k in layer_params(cfg)}
            x = self.checkpointed(
                transformer_layer, x, lp, cfg.norm_eps, cfg.d_head, cos, sin, hooks
            )
        return x

    def head_loss(self, x: torch.Tensor, labels: torch.Tensor, n_tokens: int) -> torch.Tensor:
        h = rms_norm(x, self.params["norm"], self.cfg.norm_eps)
        return cross_entropy_sum(h, self.params[head_name(self.cfg)], labels, self.tp) / n_tokens

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        local = self.head_loss(
            self.run_layers(self.embed(batch.tokens)), batch.labels, batch.n_tokens
        )
        return local, self.reported_loss(local)

    def reported_loss(self, local: torch.Tensor) -> torch.Tensor:
        return self.total_loss(local, token_axes=(Axis.SP,))  # a TP group shares its tokens

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.params.values())

    def finish_grads(self) -> None:
        super().finish_grads()
        self.all_reduce_grads(self.parameters(), self.sp)
        self.all_reduce_grads(head_partial(self.params), self.tp)

    def grad_sq_norm(self) -> torch.Tensor:
        sharded = [p for n, p in self.params.items() if shard_dim(n) is not None]
        replicated = [p for n, p in self.params.items() if shard_dim(n) is None]
        return self.tp.all_reduce_metric(grad_sq_sum(sharded)) + grad_sq_sum(replicated)

    def hidden(self, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            h = self.hidden_local(batch)
        return zigzag.unshard(list(self.sp.all_gather(h, dim=1).chunk(self.sp.size, dim=1)))

    def full_params(self, grads: bool = False) -> dict[str, torch.Tensor]:
        return gather_named(self.params, self.tp, grads)
