"""The interface every strategy implements (TSP, every baseline and the reference), in three
parts (docs/adding-a-strategy.md):

- :class:`Strategy`, what the runtime calls: it builds its sharded model from a config and a
  :class:`Mesh`, shards a global batch into this rank's inputs, computes the loss (forward),
  lets autograd run the backward, finishes the gradients (the reductions a strategy does after
  backward) and exposes its local parameters to the shared :class:`AdamW`; ``hidden`` and
  ``full_params`` gather whole tensors for checking. Its classmethods describe the strategy to
  the harness (layouts, labels, options) so that nothing switches on its name.
- ``costs``, a :class:`tspbench.core.costs.Costs`: its closed forms (bytes, memory, schedule).
- ``decoder``, a :class:`tspbench.core.decode.Decoder` subclass, or None: its decode path.

A concrete strategy that leaves out any of them, or whose costs or decoder still has an
abstract member, is refused when its class is defined (``__init_subclass__``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.utils.checkpoint

from tspbench.core import moe, recompute, zigzag
from tspbench.core.comm import Comm
from tspbench.core.config import ConfigError, ModelConfig
from tspbench.core.costs import Costs, Spec
from tspbench.core.decode import Decoder
from tspbench.core.grad_sync import BucketedAllReduce
from tspbench.core.init import Index
from tspbench.core.layout import Layout
from tspbench.core.mesh import Axis, Mesh
from tspbench.core.options import Option, Options, Value
from tspbench.core.reference import init_param, init_param_flat
from tspbench.core.stage import Stage
from tspbench.core.stage import check as check_stages

RECOMPUTE = ("none", "full")


def tensor_of(p: torch.Tensor, grads: bool) -> torch.Tensor:
    """``p``, or its gradient (after a backward), detached: what ``full_params`` gathers."""
    t = p.grad if grads else p
    assert t is not None, "no gradient: gather grads after the backward"
    return t.detach()


@dataclass
class Batch:
    """This rank's inputs: tokens/labels [b, s_local] and the token count of the global loss."""

    tokens: torch.Tensor
    labels: torch.Tensor
    n_tokens: int


REQUIRED = ("name", "display", "costs", "decoder")  # every concrete strategy sets these


class Strategy(ABC):
    name: ClassVar[str]  # the registry's, records' and command line's name
    display: ClassVar[str]  # legends, titles and tables' captions
    costs: ClassVar[Costs]  # its closed forms (tspbench/core/costs.py)
    decoder: ClassVar[type[Decoder] | None]  # its decode path (tspbench/core/decode.py), or None
    reference: ClassVar[bool] = False  # the single-device reference the others are checked on
    factored: ClassVar[bool] = False  # takes a sweep's T x Sigma factor list (its `tpsp` key)
    options: ClassVar[tuple[Option, ...]] = ()  # its own settings (tspbench/core/options.py)
    # another strategy's layout in another library's code (PyTorch's FSDP2 for FSDP+CP): measured
    # beside it, never planned or projected apart from it (the planner chooses layouts)
    implements: ClassVar[str | None] = None
    # runs as a pipeline stage (builds only a Stage's parameters; embed/run_layers/head_loss)
    stages: ClassVar[bool] = False
    # runs as a stage of a zero-bubble schedule, whose backward is split into an input and a
    # weight pass (torch's graph split, or the strategy's own: :meth:`split_backward`); opted
    # into once checked against the reference (tests/integration/test_pipeline_parallel.py)
    zero_bubble: ClassVar[bool] = False
    # runs a model with experts (tspbench/core/moe.py): its layers' MoE block is its own
    experts: ClassVar[bool] = False

    def __init_subclass__(cls, **kw: Any) -> None:
        """Refuse a concrete strategy that lacks a part, at its definition (import) time: a
        silent default would run, or be projected, wrongly (a schedule of 0 bytes)."""
        super().__init_subclass__(**kw)
        if any(getattr(getattr(cls, n, None), "__isabstractmethod__", False) for n in dir(cls)):
            return  # still abstract: an intermediate base (ABCMeta marks it only after this)
        missing = [k for k in REQUIRED if not hasattr(cls, k)]
        if missing:
            raise TypeError(f"strategy {cls.__name__}: lacks {', '.join(missing)}")
        if not isinstance(cls.costs, Costs):
            raise TypeError(f"strategy {cls.name}: costs must be a tspbench.core.costs.Costs")
        dec = cls.decoder
        if dec is not None and not (isinstance(dec, type) and issubclass(dec, Decoder)):
            raise TypeError(f"strategy {cls.name}: decoder must be a Decoder subclass or None")
        if dec is not None and getattr(dec, "__abstractmethods__", None):
            raise TypeError(
                f"strategy {cls.name}: decoder {dec.__name__} leaves abstract: "
                + ", ".join(sorted(dec.__abstractmethods__))
            )

    def __init__(
        self,
        cfg: ModelConfig,
        mesh: Mesh,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        recompute: str = "none",
        dp_bucket_mb: float = 25.0,
        stage: Stage | None = None,
        **options: Value,
    ) -> None:
        """``options``: values of the strategy's declared options (the rest at their defaults),
        each an attribute of the same name; ``stage``: the pipeline stage it builds (default:
        the whole model)."""
        if recompute not in RECOMPUTE:
            raise ConfigError(f"recompute={recompute!r}: must be one of {', '.join(RECOMPUTE)}")
        self.cfg, self.mesh, self.seed = cfg, mesh, seed
        self.dtype, self.device = dtype, torch.device(device)
        self.recompute, self.dp_bucket_mb = recompute, dp_bucket_mb
        self.stage = stage or Stage.whole(cfg)
        for name, value in Options(type(self).options, options, self.name).items():
            setattr(self, name, value)
        self._dp_sync: BucketedAllReduce | None = None
        self.routed: torch.Tensor | None = None  # experts: the last step's rows per expert
        self.router_stats: moe.RouterStats | None = None  # experts: a step's routing so far

    def checkpointed(self, fn, *args):
        """Run one transformer layer, under activation checkpointing when recompute is 'full'.

        Recomputation re-runs the layer's forward, collectives included, in backward: every rank
        does so for the same layers in the same order, so collective order stays identical.
        """
        if self.recompute == "full" and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(
                fn, *args, use_reentrant=False, context_fn=recompute.contexts
            )
        return fn(*args)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def mesh_dims(cls, layout: Layout) -> dict[str, int]:
        """Mesh axes (outermost first): data parallel outside, the D-rank model group inside."""
        return {Axis.DP: layout.dp, Axis.MODEL: layout.degree}

    @classmethod
    def validate(
        cls, cfg: ModelConfig, layout: Layout, seq_len: int, batch: int, **options: Value
    ) -> None:
        """Raise ConfigError (naming value and rule) before any collective for a bad combination
        (``options``: the run's values of the strategy's own options, checked by their type)."""
        for field in ("degree", "tp", "sp", "dp"):
            v = getattr(layout, field)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{field}={v!r}: must be a positive integer")
        if batch < 1 or seq_len < 1:
            raise ConfigError(f"batch={batch}, seq_len={seq_len}: must be positive")
        if layout.pp > 1 and not cls.stages:
            raise ConfigError(
                f"pp={layout.pp}: strategy {cls.name} does not run as a pipeline stage yet "
                "(docs/running.md lists those that do)"
            )
        check_stages(cfg, layout.pp)
        if cfg.moe and not cls.experts:
            raise ConfigError(
                f"model.experts={cfg.experts}: strategy {cls.name} runs dense models only"
                " (docs/models.md, 'Mixture of experts', lists those with experts)"
            )
        if cfg.moe and cfg.aux_loss and layout.pp > 1:
            raise ConfigError(
                f"model.aux_loss={cfg.aux_loss} with pp={layout.pp}: the load-balancing loss is "
                "the whole batch's and a pipeline stage sees one micro-batch at a time; "
                "pipelines take experts without it (--set aux_loss=0, Mixtral's default)"
            )

    @staticmethod
    def require_divisible(what: str, value: int, by: int, by_name: str) -> None:
        if value % by:
            raise ConfigError(f"{what}={value}: must be divisible by {by_name}={by}")

    def init_block(self, name: str, rows: Index = None, cols: Index = None) -> torch.Tensor:
        """Only ``full[rows][:, cols]`` of a parameter's fp32 init (default: all of it), made on
        this rank's device: no rank builds a weight it does not keep."""
        return init_param(self.cfg, name, self.seed, rows, cols, self.device)

    def init_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of a parameter's flattened fp32 init, on this rank's device."""
        return init_param_flat(self.cfg, name, self.seed, start, stop, self.device)

    def to_param(self, t: torch.Tensor) -> torch.nn.Parameter:
        """A parameter that owns exactly its elements: a shard sliced from a full tensor on the
        same device would otherwise keep the whole tensor's storage alive."""
        t = t.to(device=self.device, dtype=self.dtype).contiguous()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        return torch.nn.Parameter(t)

    # -- running --------------------------------------------------------------------------------
    @abstractmethod
    def shard_batch(self, tokens: torch.Tensor, labels: torch.Tensor) -> Batch:
        """This rank's slice of the global batch [B, S] (already on every rank)."""

    @abstractmethod
    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(local loss to call backward on, global mean loss for reporting, detached)."""

    def schedule_done(self) -> None:  # noqa: B027 (a hook: a no-op unless a stage keeps)
        """A pipeline schedule's step is over (every micro-batch through this stage): what a
        stage kept across its micro-batches is dropped (the default keeps nothing)."""

    def finish_grads(self) -> None:
        """Gradient reductions after backward; the base sums gradients over data-parallel replicas.

        Subclasses call this first, then reduce over their model group: the data-parallel sums
        were issued from the gradients as backward left them, and sums commute.
        """
        if self._dp_sync is not None:
            self._dp_sync.finish()

    def dp_sync(self) -> BucketedAllReduce | None:
        """The data-parallel gradient reducer, created (hooks registered) on first use."""
        dp = self.mesh.comms.get(Axis.DP)
        if self._dp_sync is None and dp is not None and dp.size > 1:
            self._dp_sync = BucketedAllReduce(self.parameters(), dp, int(self.dp_bucket_mb * 2**20))
        return self._dp_sync

    @staticmethod
    def all_reduce_grads(params: list[torch.nn.Parameter], comm: Comm) -> None:
        """Sum the gradients of ``params`` over ``comm`` in one packed all-reduce, unpacked by
        one multi-tensor copy."""
        grads = [p.grad for p in params if p.grad is not None]
        if comm.size == 1 or not grads:
            return
        flat = comm.all_reduce(torch.cat([g.flatten() for g in grads]))
        parts = flat.split([g.numel() for g in grads])
        torch._foreach_copy_(grads, [f.view_as(g) for g, f in zip(grads, parts)])

    def zigzag_batch(self, tokens: torch.Tensor, labels: torch.Tensor, comm: Comm) -> Batch:
        """This replica's micro-batch, this rank's zigzag chunks of every sequence."""

        def local(t: torch.Tensor) -> torch.Tensor:
            return zigzag.shard(self.dp_slice(t), comm.size, comm.rank).to(self.device)

        return Batch(local(tokens), local(labels), tokens.numel())

    def dp_slice(self, t: torch.Tensor) -> torch.Tensor:
        """This replica's micro-batch rows of a global batch (``batch`` rows per replica)."""
        dp = self.mesh.comms.get(Axis.DP)
        if dp is None or dp.size == 1:
            return t
        b = t.shape[0] // dp.size
        return t[dp.rank * b : (dp.rank + 1) * b]

    def total_loss(
        self, local: torch.Tensor, token_axes: tuple[str, ...] = (Axis.MODEL,)
    ) -> torch.Tensor:
        """Global mean loss: sum the local contributions over the axes that split tokens and dp."""
        total = local.detach().clone()
        for axis in (*token_axes, Axis.DP):
            if axis in self.mesh.comms:
                self.mesh[axis].all_reduce_metric(total)
        return total

    def routing_done(
        self, stats: moe.RouterStats, token_axes: tuple[str, ...] = (Axis.MODEL,)
    ) -> torch.Tensor | float:
        """After a forward of a model with experts: keep the step's routed rows per expert
        (``routed``, the record's tokens per expert; this rank's tokens, every layer) and
        return this rank's share of the load-balancing loss times its coefficient (0 without
        one): the top-k counts summed over the axes that split tokens and dp (one small
        all-reduce each, counted: real traffic), its own tokens' router probabilities
        (tspbench/core/moe.py). ``token_axes``: where this rank's tokens are its own."""
        self.routed = moe.local_counts(stats).detach()
        if not self.cfg.aux_loss:
            return 0.0
        counts = self.routed.clone()
        for axis in (*token_axes, Axis.DP):
            if axis in self.mesh.comms:
                self.mesh[axis].all_reduce(counts)
        return self.cfg.aux_loss * moe.aux_loss_part(stats, counts, self.cfg.top_k)

    def routing_counted(self, stats: moe.RouterStats) -> None:
        """A pipeline stage's routing over a step's micro-batches, kept as ``routed`` for the
        record (its layers, this rank's tokens), as :meth:`routing_done` keeps a whole step's;
        without the load-balancing loss, which pipelines refuse."""
        self.routed = moe.local_counts(stats).detach()

    def reported_loss(self, local: torch.Tensor) -> torch.Tensor:
        """The global mean loss from this rank's ``local`` part (collective): summed over the
        model group's token split and the replicas (a strategy whose every rank holds the whole
        loss sums over the replicas only)."""
        return self.total_loss(local)

    @abstractmethod
    def parameters(self) -> list[torch.nn.Parameter]:
        """This rank's parameter tensors (what the optimizer steps)."""

    def local_numel(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @abstractmethod
    def grad_sq_norm(self) -> torch.Tensor:
        """Squared global gradient norm over the model group (each element counted once)."""

    # -- checking -------------------------------------------------------------------------------
    @abstractmethod
    def hidden(self, batch: Batch) -> torch.Tensor:
        """Final normed hidden states [B, S, h] in global order (collective; for checks)."""

    @abstractmethod
    def full_params(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Whole reference-named tensors (of the grads if ``grads``), gathered (collective)."""

    # -- shared steps ---------------------------------------------------------------------------
    def forward_backward(self, batch: Batch) -> torch.Tensor:
        self.dp_sync()
        local, total = self.loss(batch)
        local.backward()
        self.finish_grads()
        return total

    @torch.no_grad()
    def forward_only(self, batch: Batch) -> torch.Tensor:
        return self.loss(batch)[1]

    # -- a pipeline stage's three parts (strategies with ``stages``; loss() chains them) ----------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The first stage's input activations [b, s_local, h] of this rank's ``tokens``."""
        raise NotImplementedError(f"strategy {self.name}: no pipeline stages")

    def run_layers(self, x: torch.Tensor) -> torch.Tensor:
        """This stage's layers on activations [b, s_local, h] (same shape out)."""
        raise NotImplementedError(f"strategy {self.name}: no pipeline stages")

    def head_loss(self, x: torch.Tensor, labels: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """The last stage's local loss: final norm, LM head and cross-entropy of the last
        layer's output, summed over this rank's tokens and divided by ``n_tokens`` (the global
        batch's), so local losses sum to the mean over micro-batches and ranks."""
        raise NotImplementedError(f"strategy {self.name}: no pipeline stages")

    def tied_table(self) -> list[torch.nn.Parameter]:
        """With tied embeddings, this stage's parameters that hold the embedding: the first
        stage's, or the last stage's copy used as its head, split alike on both (the pipeline
        sums the two stages' gradients of them: :class:`tspbench.runtime.pipelined.Pipelined`)."""
        raise NotImplementedError(f"strategy {self.name}: no pipeline stages")

    def split_backward(self) -> Callable[[], Callable[[], None]] | None:
        """Under a zero-bubble schedule, a builder of this stage's deferred weight pass (torch's
        ``dw_builder``: called after each micro-batch's input pass, its runner at the weight
        pass), where the strategy splits its backward itself; None: torch splits it by walking
        the autograd graph (``stage_backward_input``, ``stage_backward_weight``)."""
        return None

    def decoding(self) -> Decoder:
        """This model's decode path (docs/decode.md); ConfigError where it has none."""
        if self.decoder is None:
            raise ConfigError(f"strategy={self.name!r}: has no decode path")
        return self.decoder(self)

    @classmethod
    def validate_decode(
        cls, cfg: ModelConfig, layout: Layout, prompt_len: int, new_tokens: int, batch: int,
        **options: Value,
    ) -> None:  # fmt: skip
        """Raise ConfigError (field, value, rule) for a decode run it cannot do."""
        if cls.decoder is None:
            raise ConfigError(f"strategy={cls.name!r}: has no decode path")
        if cfg.moe:
            raise ConfigError(
                f"model.experts={cfg.experts}: no strategy decodes a model with experts yet "
                "(train and infer run it)"
            )
        cls.decoder.validate(cls, cfg, layout, prompt_len, new_tokens, batch, **options)

    # -- self-description: what the harness asks instead of switching on strategy names -------
    @classmethod
    def make_layout(cls, degree: int | None, tp: int, sp: int, dp: int) -> Layout:
        """The layout of ``--degree/--tp/--sp/--dp`` (degree defaults to 1)."""
        if tp != 1 or sp != 1:
            raise ConfigError(f"--tp/--sp: only strategy tpsp takes them (got {cls.name})")
        return Layout(degree=1 if degree is None else degree, dp=dp)

    @classmethod
    def sweep_layouts(cls, degrees: list[int], factors: list[list[int]]) -> list[Layout]:
        """The model groups a sweep gives this strategy (``factors``: T x Sigma pairs)."""
        return [Layout(degree=d) for d in degrees]

    @classmethod
    def factors(cls, layout: Layout) -> dict[str, int | None]:
        """The record's ``tp``/``sp``: None where the group is not factored."""
        return {"tp": None, "sp": None}

    @classmethod
    def tag(cls, layout: Layout) -> str:
        """The strategy and its factorisation, as cell ids spell it (``tpsp-2x2``)."""
        return cls.name

    @classmethod
    def label(cls, layout: Layout) -> str:
        """The strategy and its factorisation, as tables and legends spell it."""
        return cls.name

    @classmethod
    def context_parallel(cls, layout: Layout) -> int:
        """Ranks that split one sequence into zigzag chunks (1: every rank sees whole ones)."""
        return 1

    @classmethod
    def replica_batch(cls, layout: Layout, per_rank: int = 1) -> int:
        """The smallest micro-batch giving every rank ``per_rank`` sequences' worth of work."""
        return per_rank

    # -- what the shared tests check it at (tests/integration/test_equivalence.py) -------------
    @classmethod
    def checked_layouts(cls) -> list[Layout]:
        """The model groups the shared tests must check it at (at most 4 ranks, their world)."""
        return [Layout(degree=d) for d in (1, 2, 4)]

    @classmethod
    def checked_options(cls) -> list[dict[str, Value]]:
        """Option settings the shared tests check beside the defaults: each bool flipped and
        each other choice of a str option, one at a time (a strategy adds its own mixes); not
        those of pipelines only (tests/integration/test_pipeline_parallel.py checks them)."""
        out: list[dict[str, Value]] = []
        for o in (o for o in cls.options if o.applies(1)):
            values = (not o.default,) if isinstance(o.default, bool) else o.choices
            out += [{o.name: v} for v in values if v != o.default]
        return out

    @classmethod
    def searched_values(cls, spec: Spec | None) -> dict[str, tuple[Value, ...]]:
        """The values the planner tries of each ``searched`` option for a run like ``spec``
        (None: no valid run of the group)."""
        return {o.name: o.values() for o in cls.options if o.searched}

    @classmethod
    def preset_options(cls, preset: dict[str, Any]) -> dict[str, Value]:
        """The options a hardware preset's facts (its topology) choose where the user named none
        (``tspbench project``, the planner's single runs)."""
        return {}
