"""TP's closed forms per rank: Megatron's collectives over the D ranks, GEMM weights split D
ways (the plain layer's memory otherwise, tspbench/core/costs.py)."""

from __future__ import annotations

from tspbench.core import costs
from tspbench.core.mesh import Axis
from tspbench.core.strategy import Layout


class TPCosts(costs.Costs):
    vocab_parallel_loss = True

    def tensor_degree(self, layout: Layout) -> int:
        return layout.degree

    def schedule(self, spec: costs.Spec) -> costs.Schedule:
        return costs.megatron(spec, spec.degree, Axis.MODEL)

    def metric_reductions(self, layout: Layout, train: bool) -> tuple[int, int]:
        return 1, layout.degree if train else 1  # every rank holds the whole loss
