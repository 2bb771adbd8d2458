"""SP's closed forms per rank: context parallelism's K/V gathers, whole weights, one
all-reduce of every gradient (the plain layer's memory, tspbench/core/costs.py)."""

from __future__ import annotations

from tspbench.core import costs
from tspbench.core.mesh import Axis
from tspbench.core.strategy import Layout


class SPCosts(costs.Costs):
    grad_staging_copies = 1  # finish_grads packs every gradient into one all-reduce

    def tensor_degree(self, layout: Layout) -> int:
        return 1  # whole weights on every rank

    def schedule(self, spec: costs.Spec) -> costs.Schedule:
        """Context parallelism's K/V gathers; one all-reduce of every gradient after backward."""
        ev = costs.context_parallel(spec, Axis.MODEL, spec.degree)
        n = self.param_numel(spec.cfg, spec.layout)
        costs.grads_all_reduce(ev, spec, Axis.MODEL, spec.degree, n)
        return ev

    def metric_reductions(self, layout: Layout, train: bool) -> tuple[int, int]:
        return layout.degree, 1  # the loss is summed over the sequence's chunks
