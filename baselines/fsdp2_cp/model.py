"""FSDP2+CP: PyTorch's own fully sharded data parallelism (``fully_shard``) folded with context
parallelism on the same D ranks: FSDP+CP (``baselines/fsdp_cp``) as torch implements the
weights' half, beside the suite's hand-written one.

The model is cut into the same units as FSDP+CP's (embedding; each layer; final norm + LM
head), each an ``nn.Module`` under ``fully_shard`` as torchtitan applies it (every block, then
the root), built on the meta device and given only this rank's rows (FSDP2 shards every
parameter along dim 0, padding the last rank's). FSDP2 decides when to all-gather a unit, when to
free it (after its forward, ``reshard_after_forward``), what to prefetch in backward (the unit
below, by default) and when to reduce-scatter its gradients; the suite only routes its two
collectives through the counted :class:`tspbench.core.comm.Comm` (FSDP2's
``set_custom_all_gather`` / ``set_custom_reduce_scatter``: the same buffers, bytes counted as
every strategy's are, the step's traffic traceable and skippable for the overlap benchmark) and
asks for sums (``set_gradient_divide_factor(1)``: the ranks share sequences, as in FSDP+CP).
Tokens are zigzag over the same ranks with the core's exchanges (``cp_comm``), as FSDP+CP's.

The optimizer is the suite's shared AdamW over this rank's shards (aliases of FSDP2's local
tensors, so the in-place step is FSDP2's next all-gather input), not one over DTensors: every
strategy's update is the same kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from baselines.fsdp2_cp.costs import FSDP2CPCosts
from tspbench.core import zigzag
from tspbench.core.comm import Comm
from tspbench.core.config import ConfigError, ModelConfig
from tspbench.core.context_parallel import (
    SequenceSharded,
    cp_tables,
    exchange_groups,
)
from tspbench.core.init import chunk_slice
from tspbench.core.layers import LayerHooks, rms_norm, transformer_layer
from tspbench.core.mesh import Axis, Mesh
from tspbench.core.optim import grad_sq_sum
from tspbench.core.options import CP_A2A, CP_COMM, Value
from tspbench.core.reference import param_shapes, unit_names
from tspbench.core.strategy import Batch, Layout, tensor_of


def _fsdp2():
    """torch's ``fully_shard`` and the custom-collective interfaces, or a one-line ConfigError
    where this torch lacks them (they arrived after the suite's floor's predecessors)."""
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError as e:  # pragma: no cover - every supported torch has them
        raise ConfigError(
            f"strategy=fsdp2_cp: this torch lacks FSDP2's custom collectives ({e})"
        ) from e
    for needed in ("set_custom_all_gather", "set_force_sum_reduction_for_comms"):
        if not hasattr(FSDPModule, needed):  # pragma: no cover
            raise ConfigError(f"strategy=fsdp2_cp: this torch's FSDP2 has no {needed}")
    return fully_shard, AllGather, ReduceScatter


def _counted(comm: Comm):
    """FSDP2's all-gather and reduce-scatter through ``comm`` (counted), on the buffers FSDP2
    allocates, waited for when issued (FSDP2 on a GPU issues them on streams of its own)."""
    _, all_gather, reduce_scatter = _fsdp2()

    class Plain:  # buffers from the device's own allocator, as FSDP2's default
        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

    class Gather(Plain, all_gather):  # type: ignore[misc,valid-type]
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            comm.all_gather_into(output_tensor, input_tensor)
            return None  # done: FSDP2 then waits for nothing

    class Scatter(Plain, reduce_scatter):  # type: ignore[misc,valid-type]
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            if op != dist.ReduceOp.SUM:
                raise RuntimeError(f"fsdp2_cp: FSDP2 asked for reduce op {op}, not a sum")
            comm.reduce_scatter_into(output_tensor, input_tensor)
            return None

    return Gather(), Scatter()


class Unit(nn.Module):
    """One FSDP2 unit: parameters under their reference names (``embed``; a layer's
    ``attn_norm``... ``w2``; ``norm`` and ``head``), built on the meta device."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(
                name, nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"))
            )

    def weights(self) -> dict[str, torch.Tensor]:
        """The parameters as they are now: FSDP2's gathered ones inside a forward."""
        return dict(self.named_parameters())


def _cross_entropy(h: torch.Tensor, head: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = (h @ head.T).float()
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


class Embed(Unit):
    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The tokens' embeddings; or, tied (``labels`` given), the head: the summed
        cross-entropy of the normed hidden states ``x`` (a second call of this unit, which FSDP2
        gathers again and whose gradient it reduce-scatters and sums into the same shard)."""
        if labels is None:
            return F.embedding(x, self.weights()["embed"])
        return _cross_entropy(x, self.weights()["embed"], labels)


class Layer(Unit):
    def forward(self, x, cfg: ModelConfig, cos, sin, hooks: LayerHooks) -> torch.Tensor:
        return transformer_layer(x, self.weights(), cfg.norm_eps, cfg.d_head, cos, sin, hooks)


class Head(Unit):
    def forward(self, x: torch.Tensor, eps: float, labels: torch.Tensor | None) -> torch.Tensor:
        """The summed cross-entropy of ``labels``, or (None) the normed hidden states."""
        w = self.weights()
        h = rms_norm(x, w["norm"], eps)
        if labels is None or "head" not in w:  # (tied: the embedding's unit is the head)
            return h
        return _cross_entropy(h, w["head"], labels)


class Model(nn.Module):
    """The units under one root (FSDP2's root runs its lazy init and the step's first and last
    hooks): a step is one call, the layers run through ``layer`` (activation checkpointing)."""

    def __init__(self, units: list[Unit]) -> None:
        super().__init__()
        self.units = nn.ModuleList(units)

    def forward(self, tokens, labels, eps: float, tables, layer) -> torch.Tensor:
        x = self.units[0](tokens)
        cos, sin, hooks = tables(x)
        for unit in self.units[1:-1]:
            x = layer(unit, x, cos, sin, hooks)
        out = self.units[-1](x, eps, labels)
        if labels is not None and not hasattr(self.units[-1], "head"):  # tied embeddings
            return self.units[0](out, labels)
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of one of FSDP2's sharded DTensors (a parameter or its gradient), or
    the tensor itself where no FSDP2 runs (one process, D = 1)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class FSDP2CP(SequenceSharded):
    name = "fsdp2_cp"
    display = "FSDP2+CP (torch)"  # legends, titles and tables' captions
    options = (CP_COMM, CP_A2A)
    cp_comm: str
    cp_a2a: int
    implements = "fsdp_cp"  # the layout it runs, in torch's code (see Strategy.implements)
    costs = FSDP2CPCosts()
    decoder = None  # no decode path (docs/decode.md), as FSDP+CP

    @classmethod
    def validate(
        cls, cfg: ModelConfig, layout: Layout, seq_len: int, batch: int, **options: Value
    ) -> None:
        _fsdp2()
        super().validate(cfg, layout, seq_len, batch, **options)

    def __init__(self, cfg: ModelConfig, mesh: Mesh, **kw) -> None:
        super().__init__(cfg, mesh, **kw)
        self.comm = mesh[Axis.MODEL]
        self.cp_groups = exchange_groups(mesh, Axis.MODEL, cfg, self.cp_comm, self.cp_a2a)
        shapes = param_shapes(cfg)
        groups = unit_names(cfg)
        kinds = [Embed] + [Layer] * cfg.layers + [Head]
        self.model = Model([
            kind({n.rsplit(".", 1)[-1]: shapes[n] for n in names}, self.dtype)
            for kind, names in zip(kinds, groups)
        ])  # fmt: skip
        self.units = self.model.units
        self.names = groups
        self.root = self._fully_shard(self.model) if dist.is_initialized() else self.model
        self.model.to_empty(device=self.device)
        self._shards: list[tuple[nn.Parameter, nn.Parameter]] = []
        D, r = self.comm.size, self.comm.rank
        with torch.no_grad():
            for unit, names in zip(self.units, self.names):
                for full, (_, p) in zip(names, unit.named_parameters()):
                    local = _local(p)
                    local.copy_(self.init_block(full, rows=chunk_slice(shapes[full][0], D, r)))
                    self._shards.append((p, nn.Parameter(local)))
        # after the root's lazy init, before the first unit runs (FSDP2's own hooks come first)
        self.units[0].register_forward_pre_hook(lambda *_: self._follow_shards())

    def _follow_shards(self) -> None:
        """Point each optimizer alias at its parameter's local shard again: FSDP2's lazy init
        (the first forward) re-homes a shard into a padded buffer of its own where it cannot
        prove the storage is already that buffer (always on fake tensors, whose storages all
        have address 0), and the alias would keep the old storage alive and stepped."""
        for p, shard in self._shards:
            local = _local(p)
            if local.untyped_storage()._cdata != shard.untyped_storage()._cdata:
                shard.data = local

    def _fully_shard(self, model: Model) -> nn.Module:
        """``fully_shard`` every unit, then the root, over the model group, with the counted
        collectives and plain sums; the root. (One process without a process group, D = 1,
        keeps the plain modules: FSDP2 would shard them over one rank, moving nothing.)"""
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed.device_mesh import DeviceMesh

        fully_shard = _fsdp2()[0]
        with unset_fake_temporarily():  # the mesh's rank table is real even on fake tensors
            device_mesh = DeviceMesh.from_group(self._group(), self.device.type)
        gather, scatter = _counted(self.comm)
        for unit in model.units:  # every block, then the root (torchtitan's order)
            fully_shard(unit, mesh=device_mesh)
        root = fully_shard(model, mesh=device_mesh)
        for m in [*model.units, root]:
            m.set_custom_all_gather(gather)
            m.set_custom_reduce_scatter(scatter)
            m.set_gradient_divide_factor(1.0)  # sums: the ranks share sequences
            m.set_force_sum_reduction_for_comms(True)  # a plain sum, no pre/post-scaled op
        return root

    def _group(self) -> dist.ProcessGroup:
        """The model group's process group; for D = 1 a group of this rank alone (FSDP2 needs a
        mesh; every rank makes every singleton group, as group creation is collective)."""
        if self.comm.group is not None:
            return self.comm.group
        mine, _ = dist.new_subgroups_by_enumeration([[i] for i in range(dist.get_world_size())])
        return mine

    # -- the model ------------------------------------------------------------------------------
    def shard_batch(self, tokens: torch.Tensor, labels: torch.Tensor) -> Batch:
        return self.zigzag_batch(tokens, labels, self.comm)

    def _run(self, batch: Batch, labels: torch.Tensor | None) -> torch.Tensor:
        """The root's forward: the summed loss of ``labels``, or (None) the normed hidden."""
        cfg, S = self.cfg, batch.tokens.shape[1] * self.comm.size

        def tables(x: torch.Tensor):
            return cp_tables(self, S, self.comm, cfg, x, self.cp_comm, groups=self.cp_groups)

        def layer(unit: nn.Module, x, cos, sin, hooks) -> torch.Tensor:
            return self.checkpointed(unit, x, cfg, cos, sin, hooks)

        return self.root(batch.tokens, labels, cfg.norm_eps, tables, layer)

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        local = self._run(batch, batch.labels) / batch.n_tokens
        return local, self.total_loss(local)

    def finish_grads(self) -> None:
        """FSDP2 has reduce-scattered every gradient by the end of backward (its root's final
        callback): hand each shard's to the optimizer's alias and the data-parallel reducer."""
        for p, shard in self._shards:
            shard.grad = None if p.grad is None else _local(p.grad)
            p.grad = None  # or FSDP2 would accumulate the next step's into it
            if self._dp_sync is not None and shard.grad is not None:
                self._dp_sync.grad_ready(shard)
        super().finish_grads()

    def parameters(self) -> list[nn.Parameter]:
        return [shard for _, shard in self._shards]

    def grad_sq_norm(self) -> torch.Tensor:
        return self.comm.all_reduce_metric(grad_sq_sum(self.parameters()))

    def hidden(self, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            h = self._run(batch, None)
        return zigzag.unshard(list(self.comm.all_gather(h, dim=1).chunk(self.comm.size, dim=1)))

    def full_params(self, grads: bool = False) -> dict[str, torch.Tensor]:
        shapes = param_shapes(self.cfg)
        names = [n for unit in self.names for n in unit]  # the order _shards was built in
        return {
            n: self._gather_rows(tensor_of(shard, grads), shapes[n])
            for n, (_, shard) in zip(names, self._shards)
        }

    def _gather_rows(self, t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """The whole tensor of FSDP2's uneven dim-0 shards (padded to gather, then cut)."""
        D = self.comm.size
        size = -(-shape[0] // D)
        padded = F.pad(t, (0, 0) * (t.dim() - 1) + (0, size - t.shape[0]))
        return self.comm.all_gather(padded, dim=0)[: shape[0]]
