"""FSDP+CP: fully sharded weights folded with context parallelism on the same D ranks.

Weights, gradients and AdamW state are 1/D per rank at rest: the model is cut into units
(embedding; each layer; final norm + LM head), each flattened and split into D equal shards.
Before a unit runs, its shard is all-gathered; after the forward the gathered copy is dropped
(saved-tensor hooks keep only a *recipe* for the weights the backward needs) and it is
all-gathered again when the backward reaches the unit; the gradient is reduce-scattered back to
the shards (summed: the ranks share sequences, so sums, not averages, are wanted). Tokens are
zigzag over the same D ranks with K/V all-gather attention, exactly as in SP; with
``cp_comm=a2a``, as SP's, the Ulysses all-to-alls instead (ZeRO-3 weights with Ulysses:
DeepSpeed's long-context recipe).

With ``overlap`` on (the default), as FSDP2 does by default: before unit i runs, unit i+1's
all-gather is issued asynchronously (at most one prefetched unit alive besides the one in use);
when the backward regathers unit i (or, under recomputation, re-runs it), unit i-1's gather
starts; and each unit's gradient reduce-scatter is issued asynchronously and finished when the
next one is issued (one in flight), the last in ``finish_grads``, which assigns the gradients.
With ``overlap`` off every collective is waited for at once. The K/V all-gathers are blocking
either way (docs/method.md section 8: what Megatron's all-gather context parallelism does too).

With experts, as torchtitan composes FSDP with context and expert parallelism (its
``parallelize.py``: EP borrows the FSDP and CP degrees, here all D): rank p owns experts
p E/D .. (p+1) E/D - 1 whole, outside the layer's unit (torchtitan shards them again over the
FSDP ranks outside EP, here none: ``fully_shard`` over one rank gathers nothing); the router
and a shared expert stay in the unit, gathered as the attention's weights. Each rank routes
its own tokens (its zigzag chunks) and meets the experts by the all-to-all dispatcher
(tspbench/core/expert_parallel.py, as TSP's ``all_to_all`` schedule), so only activations move
for the experts; an expert's gradient is complete after the combine's backward (every rank's
rows reached it), so it is neither reduced nor scattered over the group.

Written plainly rather than with FSDP2's ``fully_shard`` so that its traffic goes through the
same counted collectives as every other strategy (FSDP2's collectives bypass them) and the
gradient reduction is an explicit sum.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

from baselines.fsdp_cp.costs import FSDPCPCosts
from tspbench.core import moe, zigzag
from tspbench.core.comm import Pending
from tspbench.core.config import ModelConfig
from tspbench.core.context_parallel import (
    SequenceSharded,
    cp_tables,
    exchange_groups,
)
from tspbench.core.expert_parallel import dispatch_combine
from tspbench.core.init import chunk_slice
from tspbench.core.layers import rms_norm, transformer_layer
from tspbench.core.mesh import Axis, Mesh
from tspbench.core.optim import grad_sq_sum
from tspbench.core.options import CP_A2A, CP_COMM, OVERLAP, Option, Value
from tspbench.core.reference import param_shapes, unit_names
from tspbench.core.strategy import Batch, Layout, tensor_of

PP_KEEP_GATHERED = Option(
    "pp_keep_gathered", True,
    "in a pipeline stage: gather each unit once a step and keep it over the micro-batches, "
    "reduce-scatter the summed gradients once after the last (torch's PipelineStage with FSDP2, "
    "torchtitan's default with pipelines); off: regather and reduce-scatter every micro-batch "
    "(ZeRO-3's memory, the weights' traffic M times)",
    searched=True, pipelines_only=True, tag="-ppkeep-{value}", label=" (units per micro-batch)",
    short="keep",
)  # fmt: skip


@dataclass
class Unit:
    """One all-gather unit: named parameters flattened into one padded buffer, 1/D held here."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    shard: torch.nn.Parameter

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        sizes = [math.prod(s) for s in self.shapes]
        parts = flat[: sum(sizes)].split(sizes)
        return {n.rsplit(".", 1)[-1]: p.view(s) for n, p, s in zip(self.names, parts, self.shapes)}


@dataclass(frozen=True)
class Regather:
    """What the backward keeps instead of a gathered weight: where to find it again."""

    unit: int
    shape: torch.Size
    stride: tuple[int, ...]
    offset: int


class GatherUnit(torch.autograd.Function):
    """All-gather a unit forward; reduce-scatter its gradient backward (and drop the regather).
    A unit used again later in the forward (tied embeddings: the head) holds its gradient
    until its first use's backward adds to it: one reduce-scatter, as FSDP2 does."""

    @staticmethod
    def forward(ctx, shard, owner: FSDPCP, unit: int):
        ctx.meta = (owner, unit, owner.reusing)
        return owner.gather(unit)

    @staticmethod
    def backward(ctx, g):
        owner, unit, reused = ctx.meta
        if owner.keep:  # summed over the micro-batches, reduce-scattered in finish_grads
            held = owner.full_grads.get(unit)
            owner.full_grads[unit] = g if held is None else held.add_(g)
            return None, None, None
        owner.regathered.pop(unit, None)
        if reused:  # the later use's backward runs first: keep its gradient for the earlier's
            owner.held[unit] = g
            return None, None, None
        held = owner.held.pop(unit, None)
        return owner.reduce_grad(unit, g if held is None else held.add_(g)), None, None


class FSDPCP(SequenceSharded):
    name = "fsdp_cp"
    display = "FSDP+CP"  # legends, titles and tables' captions
    options = (OVERLAP, CP_COMM, CP_A2A, PP_KEEP_GATHERED)
    overlap: bool  # set from the options (Strategy.__init__)
    cp_comm: str
    cp_a2a: int
    pp_keep_gathered: bool
    costs = FSDPCPCosts()
    decoder = None  # no decode path (docs/decode.md)
    stages = True  # (not zero_bubble: torch's graph split of its backward stops in its
    # units' autograd, "not used in the graph", and it has no split of its own yet)
    experts = True

    @classmethod
    def validate(
        cls, cfg: ModelConfig, layout: Layout, seq_len: int, batch: int, **options: Value
    ) -> None:
        super().validate(cfg, layout, seq_len, batch, **options)
        if cfg.moe:  # E/D experts each
            cls.require_divisible("model.experts", cfg.experts, layout.degree, "D (degree)")

    @classmethod
    def checked_options(cls) -> list[dict[str, Value]]:
        """Each option's other value, and the ring with every collective waited for at once."""
        return [*super().checked_options(), {"cp_comm": "ring", "overlap": False}]

    def __init__(self, cfg: ModelConfig, mesh: Mesh, **kw) -> None:
        super().__init__(cfg, mesh, **kw)
        self.comm = mesh[Axis.MODEL]
        self.cp_groups = exchange_groups(mesh, Axis.MODEL, cfg, self.cp_comm, self.cp_a2a)
        shapes = param_shapes(cfg)
        self.units = []
        order = unit_names(cfg)
        if self.stage.tied_copy:  # the last stage's copy of the embedding: its head, after
            order = order[1:] + order[:1]  # the norm's unit
        for names in order:
            if self.stage.holds(names[0]):  # (a pipeline stage: its units)
                names = [n for n in names if n.rsplit(".", 1)[-1] not in moe.EXPERTS]
                shard = self.to_param(self.shard(names))
                self.units.append(Unit(names, [shapes[n] for n in names], shard))
        # with experts: this rank's E/D of each layer's stacks, whole, outside the units
        mine = chunk_slice(cfg.experts, self.comm.size, self.comm.rank) if cfg.moe else None
        self.experts_here = [
            {k: self.to_param(self.init_block(f"layers.{i}.{k}", mine)) for k in moe.EXPERTS}
            for i in (self.stage.layers if cfg.moe else ())
        ]
        # the unit of this stage's first layer: after the embedding's on the first stage
        self.first_layer_unit = int(self.stage.first)
        self.regathered: dict[int, torch.Tensor] = {}
        self.prefetched: dict[int, Pending] = {}  # at most one unit's gather in flight
        self.reusing = False  # tied embeddings: the head gathers the first unit once more
        self.held: dict[int, torch.Tensor] = {}  # a reused unit's gradient, until its first use
        # in a pipeline stage, as torch's PipelineStage runs FSDP2 (PP_KEEP_GATHERED): the units
        # gathered at the first micro-batch, kept to the schedule's end; their full gradients
        self.keep = self.pp_keep_gathered and self.stage.count > 1
        self.kept: dict[int, torch.Tensor] = {}
        self.full_grads: dict[int, torch.Tensor] = {}
        self.reducing: list[tuple[int, torch.Tensor, Pending]] = []  # (unit, gradient, its RS)

    def shard(self, names: list[str]) -> torch.Tensor:
        """This rank's chunk of the unit's flat, zero-padded concatenation of ``names``: only the
        parts of each parameter that fall in the chunk are generated."""
        D, r, shapes = self.comm.size, self.comm.rank, param_shapes(self.cfg)
        total = sum(math.prod(shapes[n]) for n in names)
        size = -(-total // D)
        lo, hi, parts, offset = r * size, (r + 1) * size, [], 0
        for n in names:
            numel = math.prod(shapes[n])
            if offset < hi and lo < offset + numel:
                parts.append(self.init_flat(n, lo - offset, hi - offset))
            offset += numel
        flat = torch.cat(parts) if parts else torch.zeros(0, device=self.device)
        return F.pad(flat, (0, size - flat.numel()))

    # -- the FSDP mechanics ---------------------------------------------------------------------
    reduce_scatters_in_flight: ClassVar[int] = 1  # FSDP2's: the next waits for the previous

    def gather(self, unit: int) -> torch.Tensor:
        """Unit ``unit``'s weights, gathered: its prefetch, or gathered now. With ``overlap`` the
        next unit of this pass starts gathering before this one is used: forward the one above;
        in backward (a regather, or a recompute) the one below, down to the stage's first layer
        (the embedding saves no weight: it is never regathered)."""
        if unit in self.kept:
            return self.kept[unit]
        pending = self.prefetched.pop(unit, None)
        shard = self.units[unit].shard
        flat = pending.wait() if pending is not None else self.comm.all_gather(shard, dim=0)
        backward = torch._C._current_graph_task_id() != -1  # inside the autograd engine
        nxt = unit - 1 if backward else unit + 1
        ahead = not self.reusing  # (the head's use of the embedding has no unit after it)
        if (
            self.overlap
            and ahead
            and int(backward) * self.first_layer_unit <= nxt < len(self.units)
            and nxt not in self.prefetched
            and nxt not in self.kept
        ):
            self.prefetched[nxt] = self.comm.all_gather(self.units[nxt].shard, dim=0, async_op=True)
        if self.keep:
            self.kept[unit] = flat
        return flat

    def _regather(self, unit: int) -> torch.Tensor:
        if unit not in self.regathered:
            with torch.no_grad():
                self.regathered[unit] = self.gather(unit)
        return self.regathered[unit]

    def reduce_grad(self, unit: int, g: torch.Tensor) -> torch.Tensor | None:
        """Unit ``unit``'s gradient summed and scattered to the shards: returned (overlap off), or
        issued asynchronously once the previous one is done, and assigned when finished."""
        if not self.overlap:
            return self.comm.reduce_scatter(g, dim=0)
        self.finish_reduces(keep=self.reduce_scatters_in_flight - 1)
        self.reducing.append((unit, g, self.comm.reduce_scatter(g, dim=0, async_op=True)))
        return None

    def finish_reduces(self, keep: int = 0) -> None:
        """Wait for the oldest reduce-scatters until ``keep`` are in flight; accumulate their
        results into the shards' gradients (as autograd would) and hand each to the
        data-parallel reducer (whose hook only autograd's accumulation fires)."""
        while len(self.reducing) > keep:
            unit, g, pending = self.reducing.pop(0)
            grad = pending.wait()
            del g  # the full gradient lives until its reduce-scatter is done
            self._assign(unit, grad)

    def _assign(self, unit: int, grad: torch.Tensor) -> None:
        shard = self.units[unit].shard
        if shard.grad is None:
            shard.grad = grad
        else:
            shard.grad += grad
        if self._dp_sync is not None:
            self._dp_sync.grad_ready(shard)

    def finish_grads(self) -> None:
        """The pipeline's summed unit gradients reduce-scattered (kept units), and the last
        reduce-scatter finished; then the data-parallel sums."""
        for unit in sorted(self.full_grads, reverse=True):  # (the backward's order)
            reduced = self.reduce_grad(unit, self.full_grads.pop(unit))
            if reduced is not None:  # (overlap off: waited for at once)
                self._assign(unit, reduced)
        self.finish_reduces()
        super().finish_grads()

    def schedule_done(self) -> None:
        """The pipeline's step is over: the kept units are dropped (resharded)."""
        self.kept.clear()

    def run_unit(self, unit: int, fn, *args):
        """Gather unit ``unit``, run ``fn(weights, *args)``; save no gathered weight."""
        flat = GatherUnit.apply(self.units[unit].shard, self, unit)
        if self.keep or (self.recompute == "full" and torch.is_grad_enabled()):
            # Kept units stay gathered anyway. Under activation checkpointing the layer keeps
            # only its input, and its recompute gathers the unit again: the hooks below would
            # only shadow the checkpoint's own.
            return fn(self.units[unit].views(flat), *args)
        # identity, not data_ptr (fake tensors have none); weak, or the hook would keep it alive
        storage = weakref.ref(flat.untyped_storage())

        def pack(t: torch.Tensor):
            if t.untyped_storage() is storage():
                return Regather(unit, t.shape, t.stride(), int(t.storage_offset()))
            return t

        def unpack(obj):
            if isinstance(obj, Regather):
                return self._regather(obj.unit).as_strided(obj.shape, obj.stride, obj.offset)
            return obj

        with saved_tensors_hooks(pack, unpack):
            return fn(self.units[unit].views(flat), *args)

    # -- the model ------------------------------------------------------------------------------
    def shard_batch(self, tokens: torch.Tensor, labels: torch.Tensor) -> Batch:
        return self.zigzag_batch(tokens, labels, self.comm)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.run_unit(0, lambda w: F.embedding(tokens, w["embed"]))

    def run_layers(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        S = x.shape[1] * self.comm.size
        moe_hook = {"moe": self.moe_block} if cfg.moe else {}
        cos, sin, hooks = cp_tables(
            self, S, self.comm, cfg, x, self.cp_comm, self.overlap, self.cp_groups, **moe_hook
        )
        for j in range(len(self.stage.layers)):
            own = self.experts_here[j] if cfg.moe else {}
            x = self.checkpointed(
                self.run_unit,
                self.first_layer_unit + j,
                lambda w, x, own=own: transformer_layer(
                    x, {**w, **own}, cfg.norm_eps, cfg.d_head, cos, sin, hooks
                ),
                x,
            )
        return x

    def moe_block(self, m: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
        """The mixture of experts on this rank's normed tokens: routed here (the gathered
        router), met by this group's experts through the all-to-all dispatcher; a shared expert
        from the gathered unit."""
        cfg, shape = self.cfg, m.shape
        m2 = m.reshape(-1, shape[-1])
        _, weights, idx = moe.route(m2, p["router"], cfg.top_k, cfg.norm_topk, self.router_stats)

        def apply(j: int, x: torch.Tensor) -> torch.Tensor:
            return moe.expert_ffn(x, p["ew1"][j], p["ew3"][j], p["ew2"][j])

        y = dispatch_combine(m2, weights, idx, self.comm, cfg.experts, apply)
        if "sgate" in p:
            y = y + moe.shared_expert(m2, p)
        return y.view(shape)

    @property
    def head_unit(self) -> int:
        """The final norm's (and untied head's) unit: the last on the last stage (before the
        embedding's copy, with tied embeddings in a pipeline)."""
        return len(self.units) - 1 - self.stage.tied_copy

    def _body(self, batch: Batch) -> torch.Tensor:
        return self.run_layers(self.embed(batch.tokens))

    @staticmethod
    def _ce(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = (x @ w.T).float()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")

    def head_loss(self, x: torch.Tensor, labels: torch.Tensor, n_tokens: int) -> torch.Tensor:
        if self.stage.tied_copy:  # the norm's unit, then the embedding's copy as the head
            x = self.run_unit(
                self.head_unit, lambda w, x: rms_norm(x, w["norm"], self.cfg.norm_eps), x
            )
            total = self.run_unit(
                self.head_unit + 1, lambda w, x: self._ce(x, w["embed"], labels), x
            )
            return total / n_tokens

        def head(w, x):
            return self._ce(rms_norm(x, w["norm"], self.cfg.norm_eps), w["head"], labels)

        return self.run_unit(self.head_unit, head, x) / n_tokens

    def tied_table(self) -> list[torch.nn.Parameter]:
        return [u.shard for u in self.units if u.names == ["embed"]]

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        self.router_stats = moe.RouterStats() if self.cfg.moe else None
        x = self._body(batch)
        aux = 0.0 if self.router_stats is None else self.routing_done(self.router_stats)
        self.router_stats = None
        if not self.cfg.tie_embeddings:
            local = self.head_loss(x, batch.labels, batch.n_tokens) + aux
            return local, self.total_loss(local)
        # tied: the norm's unit, then the embedding's gathered again as the head; the head's
        # gradient waits for the lookup's, and the sum is reduce-scattered once (GatherUnit)
        x = self.run_unit(self.head_unit, lambda w, x: rms_norm(x, w["norm"], self.cfg.norm_eps), x)
        self.reusing = True
        try:
            total = self.run_unit(0, lambda w, x: self._ce(x, w["embed"], batch.labels), x)
        finally:
            self.reusing = False
        local = total / batch.n_tokens + aux
        return local, self.total_loss(local)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [u.shard for u in self.units] + [p for e in self.experts_here for p in e.values()]

    def grad_sq_norm(self) -> torch.Tensor:
        return self.comm.all_reduce_metric(grad_sq_sum(self.parameters()))

    def hidden(self, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            x = self._body(batch)
            h = self.run_unit(
                self.head_unit, lambda w, x: rms_norm(x, w["norm"], self.cfg.norm_eps), x
            )
        return zigzag.unshard(list(self.comm.all_gather(h, dim=1).chunk(self.comm.size, dim=1)))

    def full_params(self, grads: bool = False) -> dict[str, torch.Tensor]:
        out = {}
        for u in self.units:
            t = tensor_of(u.shard, grads)
            flat = self.comm.all_gather(t, dim=0)
            out.update({n: v for n, v in zip(u.names, u.views(flat).values())})
        for i, own in zip(self.stage.layers, self.experts_here):
            for k, p in own.items():
                out[f"layers.{i}.{k}"] = self.comm.all_gather(tensor_of(p, grads), dim=0)
        return out
