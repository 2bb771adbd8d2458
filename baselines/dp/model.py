"""DP: every rank holds the whole model; the batch's sequences are split over the D ranks and
gradients are summed with one all-reduce after backward. ``single`` is DP on one rank: the
reference model behind the strategy interface.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from baselines.dp.costs import DPCosts, SingleCosts
from baselines.dp.decode import SingleDecoder
from tspbench.core import moe
from tspbench.core.attention import attention
from tspbench.core.config import ConfigError, ModelConfig
from tspbench.core.decode import Decoder
from tspbench.core.layers import LayerHooks
from tspbench.core.mesh import Axis, Mesh
from tspbench.core.optim import grad_sq_sum
from tspbench.core.reference import ReferenceModel
from tspbench.core.strategy import Batch, Layout, Strategy, tensor_of


class DP(Strategy):
    name = "dp"
    display = "DP"  # legends, titles and tables' captions
    costs = DPCosts()
    experts = True  # the reference's own mixture of experts, every expert on every rank
    decoder: ClassVar[type[Decoder] | None] = None  # no decode path: the reference's is single's

    @classmethod
    def replica_batch(cls, layout: Layout, per_rank: int = 1) -> int:
        return per_rank * layout.degree  # each rank takes whole sequences

    @classmethod
    def validate(cls, cfg: ModelConfig, layout: Layout, seq_len: int, batch: int, **_) -> None:
        super().validate(cfg, layout, seq_len, batch)
        if batch % layout.degree:
            raise ConfigError(
                f"batch={batch}: must be divisible by degree={layout.degree} "
                "(dp gives each rank whole sequences)"
            )

    def __init__(self, cfg: ModelConfig, mesh: Mesh, **kw) -> None:
        super().__init__(cfg, mesh, **kw)
        self.comm = mesh[Axis.MODEL]
        self.model = ReferenceModel(cfg, seed=self.seed, dtype=self.dtype, device=self.device)
        # whole sequences per rank, attended by the kernel every strategy takes (flash-attn on a
        # GPU), not the reference layer's own SDPA: the comparison is of layouts, not kernels
        self.hooks = LayerHooks(attn=attention)

    def shard_batch(self, tokens: torch.Tensor, labels: torch.Tensor) -> Batch:
        n, r = self.comm.size, self.comm.rank

        def rows(t: torch.Tensor) -> torch.Tensor:
            return self.dp_slice(t).chunk(n)[r].to(self.device)

        return Batch(rows(tokens), rows(labels), tokens.numel())

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        stats = moe.RouterStats() if self.cfg.moe else None
        hidden = self.model(batch.tokens, self.checkpointed, self.hooks, stats)
        logits = (hidden @ self.model.head().T).float()
        ce = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="sum")
        local = ce / batch.n_tokens
        if stats is not None:
            local = local + self.routing_done(stats)
        return local, self.total_loss(local)

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())

    def finish_grads(self) -> None:
        super().finish_grads()
        self.all_reduce_grads(self.parameters(), self.comm)

    def grad_sq_norm(self) -> torch.Tensor:
        return grad_sq_sum(self.parameters())

    def hidden(self, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            return self.comm.all_gather(self.model(batch.tokens, hooks=self.hooks), dim=0)

    def full_params(self, grads: bool = False) -> dict[str, torch.Tensor]:
        return {n: tensor_of(p, grads) for n, p in self.model.named_full_params().items()}


class Single(DP):
    """The single-device reference (D must be 1)."""

    name = "single"
    display = "single device"  # legends, titles and tables' captions
    reference = True
    costs = SingleCosts()
    decoder = SingleDecoder

    @classmethod
    def sweep_layouts(cls, degrees: list[int], factors: list[list[int]]) -> list[Layout]:
        return [Layout()]

    @classmethod
    def checked_layouts(cls) -> list[Layout]:
        return [Layout()]

    @classmethod
    def validate(cls, cfg: ModelConfig, layout: Layout, seq_len: int, batch: int, **_) -> None:
        super().validate(cfg, layout, seq_len, batch)
        if layout.degree != 1:
            raise ConfigError(
                f"degree={layout.degree}: strategy 'single' runs one rank per replica (degree=1)"
            )
