"""DP's closed forms per rank: whole weights, one all-reduce of every gradient after backward
(the plain layer's memory, tspbench/core/costs.py); the single device's: nothing to reduce."""

from __future__ import annotations

from tspbench.core import costs
from tspbench.core.mesh import Axis
from tspbench.core.strategy import Layout


class DPCosts(costs.Costs):
    grad_staging_copies = 1  # finish_grads packs every gradient into one all-reduce

    def tensor_degree(self, layout: Layout) -> int:
        return 1  # whole weights on every rank

    def schedule(self, spec: costs.Spec) -> costs.Schedule:
        """One all-reduce of every gradient after backward (with experts and their loss, the
        counts' all-reduce each forward)."""
        ev, n = costs.Schedule(), self.param_numel(spec.cfg, spec.layout)
        costs.routing_counts(spec, ev, Axis.MODEL, spec.degree)
        costs.grads_all_reduce(ev, spec, Axis.MODEL, spec.degree, n)
        return ev

    def metric_reductions(self, layout: Layout, train: bool) -> tuple[int, int]:
        return layout.degree, 1  # the loss is summed over the ranks' sequences


class SingleCosts(DPCosts):
    grad_staging_copies = 0  # one rank: nothing to reduce

    def schedule(self, spec: costs.Spec) -> costs.Schedule:
        return costs.Schedule()
