"""A toy strategy, registered the way a new one is (docs/adding-a-strategy.md) but from outside
the package (``TSPBENCH_STRATEGIES=tests.toy_strategy:Toy``): every rank of the group runs the
whole reference model on the whole batch, so nothing moves and the group does the same work D
times. tests/integration/test_toy_strategy.py runs the CLI, the record schema and the shared
equivalence cases on it: what adding a strategy must be enough for."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tspbench.core import costs
from tspbench.core.attention import attention
from tspbench.core.layers import LayerHooks
from tspbench.core.layout import Layout
from tspbench.core.mesh import Axis
from tspbench.core.optim import grad_sq_sum
from tspbench.core.reference import ReferenceModel
from tspbench.core.strategy import Batch, Strategy, tensor_of


class ToyCosts(costs.Costs):
    def tensor_degree(self, layout: Layout) -> int:
        return 1  # whole weights everywhere

    def schedule(self, spec: costs.Spec) -> costs.Schedule:
        return costs.Schedule()  # nothing moves: every rank already has everything

    def metric_reductions(self, layout: Layout, train: bool) -> tuple[int, int]:
        return 1, 1  # every rank holds the whole loss and the whole gradients


class Toy(Strategy):
    name = "toy"
    display = "Toy (replicated)"
    costs = ToyCosts()
    decoder = None

    def __init__(self, cfg, mesh, **kw) -> None:
        super().__init__(cfg, mesh, **kw)
        self.comm = mesh[Axis.MODEL]
        self.model = ReferenceModel(cfg, seed=self.seed, dtype=self.dtype, device=self.device)
        self.hooks = LayerHooks(attn=attention)

    def shard_batch(self, tokens: torch.Tensor, labels: torch.Tensor) -> Batch:
        rows = lambda t: self.dp_slice(t).to(self.device)  # noqa: E731
        return Batch(rows(tokens), rows(labels), tokens.numel())

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(batch.tokens, self.checkpointed, self.hooks)
        logits = (hidden @ self.model.head().T).float()
        ce = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="sum")
        local = ce / batch.n_tokens
        return local, self.total_loss(local, token_axes=())

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())

    def grad_sq_norm(self) -> torch.Tensor:
        return grad_sq_sum(self.parameters())

    def hidden(self, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            return self.model(batch.tokens, hooks=self.hooks)

    def full_params(self, grads: bool = False) -> dict[str, torch.Tensor]:
        named = self.model.named_full_params()
        return {n: tensor_of(p, grads) for n, p in named.items()}
