"""FSDP+CP's closed forms per rank: every unit gathered before it runs and its gradient
reduce-scattered, on top of context parallelism's K/V gathers; the plain layer's memory
(tspbench/core/costs.py) with the gathered units in use and in flight (model.py says how)."""

from __future__ import annotations

from tspbench.core import costs
from tspbench.core.config import ModelConfig
from tspbench.core.mesh import Axis
from tspbench.core.strategy import Layout


class FSDPCPCosts(costs.Costs):
    def tensor_degree(self, layout: Layout) -> int:
        return 1  # each GEMM runs on its unit's gathered, whole weights

    @staticmethod
    def unit_numels(cfg: ModelConfig) -> tuple[int, int, int]:
        """Elements of the all-gather units: the embedding; one layer; final norm + LM head (tied:
        the norm alone, the head being the embedding's unit)."""
        V, h = cfg.vocab, cfg.hidden
        layer = costs.layer_numel(cfg) - costs.expert_numel(cfg)  # experts outside the units
        return V * h, layer, h + (0 if cfg.tie_embeddings else V * h)

    def param_numel(self, cfg: ModelConfig, layout: Layout) -> int:
        """The units' padded shards, and this rank's E/D experts of every layer."""
        u0, ul, un = (-(-u // layout.degree) for u in self.unit_numels(cfg))  # padded shards
        return u0 + cfg.layers * (ul + costs.expert_numel(cfg) // layout.degree) + un

    @staticmethod
    def kept(spec: costs.Spec) -> bool:
        """Whether ``spec`` is a pipeline stage (or one stage's micro-batch) that gathers its
        units once a step and keeps them (``pp_keep_gathered``, model.py)."""
        staged = spec.layout.pp > 1 or spec.stage_of > 1
        return staged and bool(spec.options.get("pp_keep_gathered"))

    def stage_held(self, spec: costs.Spec, numel: int) -> tuple[int, int]:
        """Kept units: the stage's gathered weights (its shards x D, padding included; none
        beyond the shards at D = 1, where a gather returns the shard) and their full gradients,
        summed over the micro-batches until finish_grads reduce-scatters them."""
        if not self.kept(spec):
            return 0, 0
        whole = numel * spec.degree * spec.e
        return whole if spec.degree > 1 else 0, whole if spec.train else 0

    def experts_meet(self, spec: costs.Spec) -> str:
        return "dispatch"  # the all-to-all dispatcher (tspbench/core/expert_parallel.py)

    def unit_bytes(self, spec: costs.Spec) -> tuple[int, int, int]:
        """Bytes of the gathered (padded) units: the embedding; one layer; final norm + head."""
        D, e = spec.degree, spec.e
        u0, ul, un = (-(-u // D) * D * e for u in self.unit_numels(spec.cfg))
        return u0, ul, un

    def schedule(self, spec: costs.Spec) -> costs.Schedule:
        """Context parallelism's K/V gathers (blocking); every unit gathered before it runs
        (forward, and again in backward), its gradient reduce-scattered. Overlapped, with
        ``overlap``: every gather but the first of a pass was issued before the unit ahead of it
        ran; every reduce-scatter but the last drains while the next unit's backward runs."""
        D, L, ov = spec.degree, spec.cfg.layers, spec.options["overlap"]
        ev = costs.context_parallel(spec, Axis.MODEL, D)
        if spec.cfg.moe:  # its experts by expert parallelism over the same ranks
            costs.routing_counts(spec, ev, Axis.MODEL, D)
            costs.dispatch_combine(spec, ev, Axis.MODEL, D)
        u0, ul, un = self.unit_bytes(spec)
        if self.kept(spec):
            return self._kept_schedule(spec, ev)
        ev.add("forward", Axis.MODEL, "all_gather", D, u0)  # waited for at once
        ev.add("forward", Axis.MODEL, "all_gather", D, ul, L, overlapped=ov)
        ev.add("forward", Axis.MODEL, "all_gather", D, un, overlapped=ov)
        tied = spec.cfg.tie_embeddings
        if tied:  # the embedding's unit again as the head, waited for at once
            ev.add("forward", Axis.MODEL, "all_gather", D, u0)
        if spec.train:  # layers: regathered (or recomputed) in backward; embedding never
            # under recompute the head unit keeps its gathered weights, so the top layer's
            # recompute starts the backward's gathers, waited for at once
            ev.add(
                "backward", Axis.MODEL, "all_gather", D, ul, L, overlapped=ov, exposed=int(spec.rc)
            )
            if not spec.rc:  # the head unit's regather starts them (tied: the embedding's
                # unit for the head, then the norm's, each waited for at once)
                ev.add("backward", Axis.MODEL, "all_gather", D, un)
                if tied:
                    ev.add("backward", Axis.MODEL, "all_gather", D, u0)
            ev.add("backward", Axis.MODEL, "reduce_scatter", D, u0)  # the last: finish_grads
            ev.add("backward", Axis.MODEL, "reduce_scatter", D, ul, L, overlapped=ov)
            ev.add("backward", Axis.MODEL, "reduce_scatter", D, un, overlapped=ov)
        return ev

    def _kept_schedule(self, spec: costs.Spec, ev: costs.Schedule) -> costs.Schedule:
        """A stage keeping its units: each gathered once a step, in its first micro-batch's
        forward (hidden behind it with ``overlap``, but for the first), never in backward; the
        summed gradients reduce-scattered once after the schedule, back to back."""
        D, L, ov = spec.degree, spec.cfg.layers, spec.options["overlap"]
        u0, ul, un = self.unit_bytes(spec)
        ev.add("forward", Axis.MODEL, "all_gather", D, u0, per_step=True)
        ev.add("forward", Axis.MODEL, "all_gather", D, ul, L, overlapped=ov, per_step=True)
        ev.add("forward", Axis.MODEL, "all_gather", D, un, overlapped=ov, per_step=True)
        if spec.train:
            for nbytes, times in ((un, 1), (ul, L), (u0, 1)):
                ev.add("backward", Axis.MODEL, "reduce_scatter", D, nbytes, times, per_step=True)
        return ev

    def inference_working_set(self, spec: costs.Spec) -> tuple[int, int]:
        """The plain model's, and the gathered unit in use; with ``overlap`` a layer also has the
        next unit's gather in flight (the top layer's: the head unit). Kept units: the plain
        model's (the stage holds them: :meth:`stage_held`)."""
        base = super().inference_working_set(spec)
        if self.kept(spec):
            return base
        return costs.gathered_unit_working_set(
            spec, base, self.unit_bytes(spec), spec.options["overlap"]
        )

    def backward_transients(self, spec: costs.Spec) -> tuple[int, int, int]:
        """The plain model's; with ``overlap``, a layer's backward also has the layer below's
        gather in flight and the gradient of the unit above still reduce-scattering
        (:func:`tspbench.core.costs.gathered_unit_transients`). Kept units: the plain model's
        (no gather or reduce-scatter runs in a backward: :meth:`stage_held`)."""
        base = super().backward_transients(spec)
        if self.kept(spec):
            return base
        return costs.gathered_unit_transients(
            spec, base, self.unit_bytes(spec), spec.options["overlap"], self.saved_per_layer(spec)
        )

    def metric_reductions(self, layout: Layout, train: bool) -> tuple[int, int]:
        return layout.degree, layout.degree if train else 1
