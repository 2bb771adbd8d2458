"""FSDP2+CP's closed forms per rank: FSDP2's unit gathers and gradient reduce-scatters (every
parameter padded to D equal dim-0 shards) on top of context parallelism's exchange; the plain
layer's memory (tspbench/core/costs.py) with the gathered units FSDP2 keeps alive."""

from __future__ import annotations

from tspbench.core import costs
from tspbench.core.config import ModelConfig
from tspbench.core.layout import Layout
from tspbench.core.mesh import Axis
from tspbench.core.reference import layer_params, param_shapes


def padded_rows(shape: tuple[int, ...], D: int) -> int:
    """Elements of one rank's dim-0 shard of a parameter, padded as FSDP2 pads it."""
    rows = -(-shape[0] // D)
    return rows * (shape[1] if len(shape) > 1 else 1)


class FSDP2CPCosts(costs.Costs):
    def tensor_degree(self, layout: Layout) -> int:
        return 1  # each GEMM runs on its unit's gathered, whole weights

    @staticmethod
    def unit_shards(cfg: ModelConfig, D: int) -> tuple[int, int, int]:
        """Elements of one rank's padded shard of each unit: the embedding; one layer; final
        norm + LM head."""
        s = param_shapes(cfg)
        layer = sum(padded_rows(s[f"layers.0.{k}"], D) for k in layer_params(cfg))
        head = padded_rows(s["head"], D) if "head" in s else 0  # (tied: the embedding's unit)
        return padded_rows(s["embed"], D), layer, padded_rows(s["norm"], D) + head

    def param_numel(self, cfg: ModelConfig, layout: Layout) -> int:
        u0, ul, un = self.unit_shards(cfg, layout.degree)
        return u0 + cfg.layers * ul + un

    def unit_bytes(self, spec: costs.Spec) -> tuple[int, int, int]:
        """Bytes of the gathered (padded) units: the embedding; one layer; final norm + head."""
        D, e = spec.degree, spec.e
        u0, ul, un = (u * D * e for u in self.unit_shards(spec.cfg, D))
        return u0, ul, un

    def schedule(self, spec: costs.Spec) -> costs.Schedule:
        """Context parallelism's exchange; every unit gathered before its forward and again
        before its backward (FSDP2 frees it after the forward), each unit's gradient
        reduce-scattered after its backward."""
        D, L = spec.degree, spec.cfg.layers
        ev = costs.context_parallel(spec, Axis.MODEL, D)
        u0, ul, un = self.unit_bytes(spec)
        ev.add("forward", Axis.MODEL, "all_gather", D, u0)
        ev.add("forward", Axis.MODEL, "all_gather", D, ul, L, overlapped=True, exposed=0)
        ev.add("forward", Axis.MODEL, "all_gather", D, un, overlapped=True)
        tied = spec.cfg.tie_embeddings  # the head calls the embedding's unit again: gathered
        if tied:  # again in forward and before its backward; its gradient reduced once
            ev.add("forward", Axis.MODEL, "all_gather", D, u0)
        if spec.train:
            if tied:
                ev.add("backward", Axis.MODEL, "all_gather", D, u0)
            ev.add("backward", Axis.MODEL, "all_gather", D, un)
            ev.add("backward", Axis.MODEL, "all_gather", D, ul, L, overlapped=True)
            ev.add("backward", Axis.MODEL, "all_gather", D, u0, overlapped=True)
            ev.add("backward", Axis.MODEL, "reduce_scatter", D, un, overlapped=True)
            ev.add("backward", Axis.MODEL, "reduce_scatter", D, ul, L, overlapped=True)
            ev.add("backward", Axis.MODEL, "reduce_scatter", D, u0)
        return ev

    def inference_working_set(self, spec: costs.Spec) -> tuple[int, int]:
        """The plain model's, and the gathered unit in use beside its gather buffer (FSDP2 on a
        CPU: the all-gather's output lives through the copy-out into the parameters; on a GPU
        the next unit's gather, prefetched on FSDP2's all-gather stream, takes its place)."""
        base = super().inference_working_set(spec)
        units = self.unit_bytes(spec)
        layer, loss = costs.gathered_unit_working_set(spec, base, units, True)
        # the head's unit's gather buffer beside it, as a layer's (tied: the embedding's unit)
        return layer, loss + units[0 if spec.cfg.tie_embeddings else 2]

    def backward_transients(self, spec: costs.Spec) -> tuple[int, int, int]:
        """The plain model's, with FSDP2's backward prefetch (the unit below gathered when a
        unit's backward starts, on every device: at the loss, the top layer beside the head
        unit) and the unit above's gradient reduce-scattering
        (:func:`tspbench.core.costs.gathered_unit_transients`)."""
        units = self.unit_bytes(spec)
        loss_t, layer_t, end_t = costs.gathered_unit_transients(
            spec, super().backward_transients(spec), units, True, self.saved_per_layer(spec)
        )
        return loss_t + units[1], layer_t, end_t

    def metric_reductions(self, layout: Layout, train: bool) -> tuple[int, int]:
        return layout.degree, layout.degree if train else 1
