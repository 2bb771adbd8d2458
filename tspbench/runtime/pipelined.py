"""Pipeline parallelism over any strategy that runs as a stage, on PyTorch's own pipelining.

World = pp x dp x D, the pipeline axis outermost (it crosses nodes; each stage's model groups
stay inside one). Stage s holds a contiguous block of layers (:class:`tspbench.core.stage.Stage`)
and runs it with its strategy on its D ranks; ``torch.distributed.pipelining`` moves each
micro-batch's activations (and in backward their gradients) point-to-point between the ranks
of equal position in neighbouring stages, in the order of its schedule (GPipe, 1F1B,
interleaved 1F1B or interleaved zero-bubble). Under interleaved 1F1B (Narayanan et al., 2021)
each rank runs :data:`VIRTUAL` stages, rank r stages r, r + pp, ...: the model is cut into
pp x VIRTUAL blocks and a micro-batch crosses the pipeline VIRTUAL times, which shrinks the
bubble VIRTUAL-fold for VIRTUAL times the sends. Interleaved zero-bubble (Qi et al., 2024;
torch's ZB1P) places the stages so too and splits each chunk's backward into an input pass and
a later weight pass that fills the bubble: torch splits it by walking the stage's autograd
graph, or the strategy splits its own (:meth:`~tspbench.core.strategy.Strategy.split_backward`,
TSP's: tsp_impl/weight_pass.py). We build each stage statically (its input and output shapes are
the strategy's local activations, [micro-batch, local tokens, h]): torch's shape inference would
run the stage's forward on meta tensors, which the strategies' collectives cannot take.

Micro-batches split this replica's batch rows. Each micro-batch's local loss is divided by the
whole batch's token count (not the micro-batch's) and the schedule does not rescale gradients,
so the summed gradients are the whole batch's, as the reference computes them.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

from tspbench.core import moe
from tspbench.core.comm import CommCounter
from tspbench.core.config import ConfigError
from tspbench.core.mesh import Axis, Mesh
from tspbench.core.strategy import Batch, Strategy

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved1f1b": ScheduleInterleaved1F1B,
    "interleavedzb": ScheduleInterleavedZeroBubble,
}
# schedules that split each backward into an input pass and a later weight pass (Qi et al.,
# 2024): each strategy splits it as it can (Strategy.split_backward, zero_bubble)
ZERO_BUBBLE = ("interleavedzb",)
# schedules the cost model and the closed forms price (the planner's); a zero-bubble one is
# measured only: check_projected
PROJECTED = tuple(s for s in SCHEDULES if s not in ZERO_BUBBLE)
# stages per rank under a schedule that runs several: torchtitan's default for its multi-stage
# schedules where no layers per stage are given
VIRTUAL = 2


def stages_per_rank(schedule: str) -> int:
    """How many stages each rank runs under ``schedule`` (1, or :data:`VIRTUAL`)."""
    return VIRTUAL if issubclass(SCHEDULES[schedule], PipelineScheduleMulti) else 1


def stage_indices(schedule: str, pp: int, rank: int) -> list[int]:
    """The stages (of pp x :func:`stages_per_rank`) that pipeline rank ``rank`` runs, in model
    order: torch's loop-style placement, rank r stages r, r + pp, ..."""
    return [rank + i * pp for i in range(stages_per_rank(schedule))]


def equal_rounds(pp: int, microbatches: int) -> bool:
    """Torch's rule for its interleaved schedule (microbatches >= pp): the micro-batches split
    into microbatches // pp rounds of equal size."""
    return microbatches % (microbatches // pp) == 0


def check(
    pp: int,
    schedule: str,
    microbatches: int,
    batch: int,
    layers: int,
    train: bool,
    impl: type[Strategy] | None = None,
) -> None:
    """Refuse, in one line naming the field and the rule, a pipeline that cannot run (with
    ``impl``, one its strategy cannot run)."""
    if microbatches < 1:
        raise ConfigError(f"microbatches={microbatches}: must be a positive integer")
    if pp == 1:
        if microbatches != 1:
            raise ConfigError(f"microbatches={microbatches}: only with pp > 1 (got pp=1)")
        return
    if schedule not in SCHEDULES:
        why = ""
        if schedule.lower() in SCHEDULES:
            why = " (spelled in lower case here)"
        elif (known := _torch_class(schedule)) is not None:
            ours = [name for name, cls in SCHEDULES.items() if cls is known]
            why = (
                f" (torch's {known.__name__}: spelled {ours[0]} here)"
                if ours
                else " (torch's, but not run here: docs/running.md, 'Pipeline parallelism')"
            )
        raise ConfigError(f"pp_schedule={schedule!r}{why}: must be one of {', '.join(SCHEDULES)}")
    if batch % microbatches:
        raise ConfigError(
            f"microbatches={microbatches}: must divide batch={batch} (each micro-batch is "
            "batch/microbatches rows of the replica's batch)"
        )
    if schedule != "gpipe" and microbatches < pp:
        raise ConfigError(
            f"microbatches={microbatches}: {schedule} needs at least pp={pp} (one in flight per "
            "stage)"
        )
    if schedule in ZERO_BUBBLE and impl is not None and not impl.zero_bubble:
        raise ConfigError(
            f"pp_schedule={schedule}: strategy {impl.name} does not split its backward into "
            "input and weight passes (docs/running.md, 'Pipeline parallelism')"
        )
    v = stages_per_rank(schedule)
    if v > 1 and not train:
        raise ConfigError(
            f"pp_schedule={schedule}: trains only here (a forward-only pipeline runs gpipe or "
            "1f1b, one schedule then)"
        )
    if v > 1 and layers % (pp * v):
        raise ConfigError(
            f"pp={pp}: {schedule} runs {v} stages per rank, so pp x {v} must divide "
            f"model.layers={layers} (each stage holds an equal block of layers)"
        )
    rounds = microbatches // pp
    if v > 1 and not equal_rounds(pp, microbatches):
        raise ConfigError(
            f"microbatches={microbatches}: {schedule} splits them into microbatches // pp = "
            f"{rounds} equal rounds (torch's rule), so they must be a multiple of {rounds}"
        )


def check_projected(schedule: str, field: str = "pp_schedule") -> None:
    """Refuse to project a schedule the model does not price, in one line."""
    if schedule in ZERO_BUBBLE:
        raise ConfigError(
            f"{field}={schedule}: a zero-bubble schedule is measured (tspbench run), not "
            "projected: the tensors its weight passes hold and the backward's split are not "
            "modelled (docs/projection.md); project one of " + ", ".join(PROJECTED)
        )
    if schedule not in SCHEDULES:
        raise ConfigError(f"{field}={schedule!r}: must be one of {', '.join(PROJECTED)}")


def _torch_class(name: str) -> type | None:
    """Torch's pipelining schedule of this name (its own lookup, any case), or None."""
    try:
        return get_schedule_class(name)
    except ValueError:
        return None


def _no_outputs(sched: Any) -> dict[str, bool]:
    """``return_outputs=False`` where this torch's schedules take it (the last stage then keeps
    no merged outputs); an older torch's ``step`` has no such parameter and would hand an
    unknown keyword to the stage's forward."""
    takes = "return_outputs" in inspect.signature(sched.step).parameters
    return {"return_outputs": False} if takes else {}


class _StageModule(nn.Module):
    """The stage as torch's pipelining wants it: a module whose forward maps the previous
    stage's output (the first stage: token ids) to this stage's; its parameters registered
    (the zero-bubble schedules split backward by them)."""

    def __init__(self, strat: Strategy) -> None:
        super().__init__()
        self.strat = strat
        self.params = nn.ParameterList(strat.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.strat.stage.first:
            x = self.strat.embed(x)
        return self.strat.run_layers(x)


class _CountedStage(PipelineStage):
    """torch's stage, with the bytes of every activation and gradient it sends counted on the
    mesh's counter (axis ``pp``, kind ``send_recv``), as the strategies' collectives are, and
    the time it computes (a micro-batch's forward or backward, its model group's collectives
    included) summed in ``busy_s``: the rest of a step is the stage's bubble."""

    counter: CommCounter
    busy_s: float = 0.0

    def _timed(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        cuda = torch.device(self.device).type == "cuda"
        if cuda:  # (the device's work, not the host's issue: synchronized at both ends)
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize(self.device)
        self.busy_s += time.perf_counter() - t0
        return out

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> None:
        self._timed(super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> None:
        self._timed(super().backward_weight_one_chunk, *args, **kwargs)

    def _counted(self, ops: list[Any]) -> list[Any]:
        for op in ops:
            self.counter.add(Axis.PP, "send_recv", op.tensor.numel() * op.tensor.element_size())
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[Any]:
        return self._counted(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[Any]:
        return self._counted(super().get_bwd_send_ops(bwd_chunk_id))


class Pipelined:
    """A rank's stages stepped by a pipeline schedule: what the runtime calls of a strategy (a
    step, the gradient norm, the parameters) over all of them, the rest asked of the first
    stage's strategy (every stage's strategy shards a batch alike)."""

    def __init__(
        self, strats: list[Strategy], mesh: Mesh, schedule: str, microbatches: int, train: bool
    ) -> None:
        self.strats, self.strat, self.mesh, self.train = strats, strats[0], mesh, train
        self.schedule, self.microbatches = schedule, microbatches
        self.pp = mesh[Axis.PP]
        self.first = any(s.stage.first for s in strats)
        self.last = any(s.stage.last for s in strats)
        self._sched: Any = None
        self._stages: list[_CountedStage] = []
        self._schedule_s = 0.0
        self._n_tokens = 0
        # tied embeddings: the first stage's embedding and the last stage's copy (its head)
        # sum their gradients over the ranks of equal position on the two (Megatron-Core's
        # embedding group); the others hold neither
        tied = train and self.strat.cfg.tie_embeddings
        self.tie = (self.pp if self.pp.size == 2 else mesh.ends(Axis.PP)) if tied else None
        self.tables = [p for s in strats if tied and s.stage.holds("embed") for p in s.tied_table()]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.strat, name)

    def _schedule_for(self, batch: Batch) -> Any:
        """torch's stages and schedule, built at the first step (the shapes are the batch's)."""
        if self._sched is not None:
            return self._sched
        cfg = self.strat.cfg
        rows, local = batch.tokens.shape[0] // self.microbatches, batch.tokens.shape[1]
        split = self.schedule in ZERO_BUBBLE
        for s in self.strats:
            act = torch.empty(rows, local, cfg.hidden, dtype=s.dtype, device="meta")
            inp = batch.tokens[:rows].to("meta") if s.stage.first else act
            stage = _CountedStage(
                _StageModule(s), s.stage.index, s.stage.count, s.device,
                input_args=(inp.requires_grad_(self.train and not s.stage.first),),
                output_args=(act.clone().requires_grad_(self.train),),
                group=self.pp.group, dw_builder=s.split_backward() if split else None,
            )  # fmt: skip
            stage.counter = self.mesh.counter
            self._stages.append(stage)
        loss = self._loss if self.train else None
        cls = SCHEDULES[self.schedule]
        one = self._stages[0] if len(self._stages) == 1 else self._stages
        self._sched = cls(one, self.microbatches, loss_fn=loss, scale_grads=False)
        return self._sched

    def _last(self) -> tuple[Strategy, _CountedStage]:
        """The last stage's strategy and torch stage (on this rank only where it is last)."""
        return next((s, st) for s, st in zip(self.strats, self._stages) if s.stage.last)

    def _loss(self, out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch (torch calls it outside the stage's forward:
        timed here as the stage's work)."""
        strat, stage = self._last()
        return stage._timed(strat.head_loss, out, labels, self._n_tokens)

    def _step(self, batch: Batch) -> torch.Tensor:
        """One step of the schedule; the global mean loss, on every rank."""
        sched = self._schedule_for(batch)
        self._n_tokens = batch.n_tokens
        experts = self.strat.cfg.moe
        for s in self.strats:  # (each stage's routing over the micro-batches, for the record)
            s.router_stats = moe.RouterStats() if experts else None
        args = (batch.tokens,) if self.first else ()
        t0 = time.perf_counter()
        if not self.last:
            sched.step(*args, **_no_outputs(sched))
            local = torch.zeros((), device=self.strat.device)
        elif self.train:
            losses: list[torch.Tensor] = []
            sched.step(*args, target=batch.labels, losses=losses, **_no_outputs(sched))
            local = torch.stack(losses).sum().detach()
        else:  # (the loss of the merged outputs: the stage's work too)
            out = sched.step(*args)
            strat, stage = self._last()
            local = stage._timed(strat.head_loss, out, batch.labels, batch.n_tokens)
        self._schedule_s += time.perf_counter() - t0
        for s in self.strats:
            s.schedule_done()
            if s.router_stats is not None:
                s.routing_counted(s.router_stats)
            s.router_stats = None
        total = self._last()[0].reported_loss(local) if self.last else local
        return self.pp.all_reduce_metric(total.float().clone())  # from the last stage

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        """A step; each stage's own gradient reductions over its model group (FSDP+CP's last
        reduce-scatters complete its shards' gradients there); a tied embedding's two copies'
        gradients summed over the pipeline's two ends; then the rank's gradients
        summed over the data-parallel replicas of the same stages, in one packed all-reduce
        (the strategies' bucketed reducer would issue it at the first micro-batch's gradients;
        the cost model charges it as not hidden: docs/running.md)."""
        total = self._step(batch)
        for s in self.strats:
            s.finish_grads()
        if self.tie is not None and self.tables:  # (sums the two copies' gradients, in place)
            self.strat.all_reduce_grads(self.tables, self.tie)
        dp = self.mesh.comms.get(Axis.DP)
        if dp is not None and dp.size > 1:
            self.strat.all_reduce_grads(self.parameters(), dp)
        return total

    @torch.no_grad()
    def forward_only(self, batch: Batch) -> torch.Tensor:
        return self._step(batch)

    def grad_sq_norm(self) -> torch.Tensor:
        """Over every stage: each stage's over its model group, summed along the pipeline; a
        tied embedding once (its copy's gradient, equal to it, left out on the last stage)."""
        parts = []
        for s in self.strats:
            copy = s.tied_table() if s.stage.tied_copy else []
            grads = [p.grad for p in copy]
            for p in copy:
                p.grad = None
            try:
                parts.append(s.grad_sq_norm())
            finally:
                for p, g in zip(copy, grads):
                    p.grad = g
        return self.pp.all_reduce_metric(torch.stack(parts).sum())

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for s in self.strats for p in s.parameters()]

    @property
    def routed(self) -> torch.Tensor | None:
        """Experts: the last step's rows per expert over this rank's stages' layers."""
        counts = [s.routed for s in self.strats if s.routed is not None]
        return torch.stack(counts).sum(0) if counts else None

    def local_numel(self) -> int:
        return sum(s.local_numel() for s in self.strats)

    def full_params(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Every stage's whole tensors (collective over each stage's model group)."""
        return {n: t for s in self.strats for n, t in s.full_params(grads).items()}

    def take_times(self) -> tuple[float, float]:
        """(seconds in the schedule's steps, seconds this rank's stages computed in them)
        since the last call: the rank's bubble is the first's rest (the optimizer step, the
        gradient reductions after the schedule and the reported metrics are in neither)."""
        assert self._stages, "no step yet"
        out = (self._schedule_s, sum(st.busy_s for st in self._stages))
        self._schedule_s = 0.0
        for st in self._stages:
            st.busy_s = 0.0
        return out


def bubble_closed_form(pp: int, microbatches: int, schedule: str = "1f1b") -> float:
    """The idle fraction of a step with equal stages (Narayanan et al., 2021): GPipe's and
    1F1B's (pp - 1) / (M + pp - 1); interleaved 1F1B's with v stages per rank, each 1/v of the
    work, (pp - 1) / (v M + pp - 1). A zero-bubble schedule's, with each chunk's forward, input
    pass and weight pass of equal time (Qi et al., 2024's assumption), (pp - 1) / (3 v M +
    pp - 1): run with its dependencies, torch's order of actions idles each rank pp - 1 slots
    of 3 v M + pp - 1 (tests/unit/test_stage.py), a third of interleaved 1F1B's bubble."""
    v = stages_per_rank(schedule)
    passes = 3 if schedule in ZERO_BUBBLE else 1  # (slots per chunk: F, I, W; or F + B)
    return (pp - 1) / (passes * v * microbatches + pp - 1)
