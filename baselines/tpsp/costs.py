"""TP+SP's closed forms per rank: Megatron over T, K/V gathers over Sigma, GEMM weights split
T ways, the gradients all-reduced over Sigma (the plain layer's memory, tspbench/core/costs.py)."""

from __future__ import annotations

from tspbench.core import costs
from tspbench.core.mesh import Axis
from tspbench.core.strategy import Layout


class TPSPCosts(costs.Costs):
    vocab_parallel_loss = True
    grad_staging_copies = 1  # finish_grads packs every gradient into one all-reduce over Sigma

    def tensor_degree(self, layout: Layout) -> int:
        return layout.tp

    def schedule(self, spec: costs.Spec) -> costs.Schedule:
        """Megatron over T, K/V gathers over Sigma; the gradients all-reduced over Sigma."""
        ev = costs.megatron(spec, spec.tp, Axis.TP, Axis.SP, spec.sp)
        n = self.param_numel(spec.cfg, spec.layout)
        costs.grads_all_reduce(ev, spec, Axis.SP, spec.sp, n)
        return ev

    def metric_reductions(self, layout: Layout, train: bool) -> tuple[int, int]:
        return layout.sp, layout.tp if train else 1
