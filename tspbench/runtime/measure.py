"""One measured run on one rank; rank 0 assembles the record.

Order of steps: three untimed *probe* steps (:func:`probe`), then ``warmup`` untimed steps, then
``steps`` timed steps. The probes: the first step under the memory tracker (its peak, the
first-step loss and gradient norm), a second under the tracker once AdamW's state exists (the
steady-state peak, ``peak_mem_bytes``), and a third under the FLOP counter alone: the counter
decomposes some kernels (``silu_backward``) into temporaries, so memory is never measured
while it is active, for any strategy. Each timed step starts after a
barrier and ends synchronized (CUDA events on GPU); a step's time is the slowest rank's, and the
record reports the median over steps. Bytes communicated are counted over the timed steps and
divided by their number.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from tspbench.core.comm import blocked_in_collective
from tspbench.core.dtypes import DTYPES
from tspbench.core.memory import REST, STAGING, MemoryTracker
from tspbench.core.mesh import Axis, build_mesh
from tspbench.core.optim import AdamW
from tspbench.core.reference import make_batch
from tspbench.core.stage import Stage
from tspbench.core.strategy import Strategy
from tspbench.runtime.faults import inject, stretched
from tspbench.runtime.flops import counter
from tspbench.runtime.guard import process_age_s
from tspbench.runtime.pipelined import (
    Pipelined,
    bubble_closed_form,
    stage_indices,
    stages_per_rank,
)
from tspbench.runtime.record_keys import MOE_SUMMARY, PIPELINE_SUMMARY, RUN_SUMMARY, ordered
from tspbench.runtime.registry import get_strategy
from tspbench.runtime.spec import RunSpec
from tspbench.runtime.timing import slowest, timed


def one_step(strat, batch, opt) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss, gradient norm) of one step: training with ``opt`` (forward, backward, norm, AdamW),
    forward only without; the same step for measured runs, fake-tensor estimates and tests."""
    if opt is None:
        return strat.forward_only(batch), None
    loss = strat.forward_backward(batch)
    gnorm = strat.grad_sq_norm().sqrt()
    opt.step()
    opt.zero_grad()
    return loss, gnorm


@contextmanager
def gc_held() -> Iterator[None]:
    """Garbage collection held off after one collection: cyclic garbage is otherwise freed at
    moments that vary run to run, and the tracked peak would not repeat to the byte.

    torch imports ``torch._dynamo`` on the first call of any dynamo-disabled wrapper (an
    autograd Function's ``apply``, say). Were that inside the held region, the import
    machinery's frames, cyclic garbage, would keep every caller's frame and its tensors alive
    until GC came back (seen: the embedding output outliving the step's crest, +13%): import it
    first."""
    import torch._dynamo  # noqa: F401

    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def gemm_rate(device: torch.device, dtype: torch.dtype, n: int = 0, reps: int = 4) -> float:
    """GFLOP/s of a fixed square matmul, measured now on this rank (a few ms).

    The run samples it before every timed step, on every rank, under the same contention as the
    steps; ``tokens_per_s / calib_gflops`` (medians) then cancels much of the machine's speed
    and load (not all: under another job's bursts it moved by up to 1.5x between runs of the
    same code, so the regression check times code A/B on one machine instead, docs/pipeline.md).
    Its size (``n`` 0: the device's): 384 on a CPU; 4096 on a GPU, where a small one would time
    the launches.
    """
    n = n or (4096 if device.type == "cuda" else 384)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def gemms() -> None:
        for _ in range(reps):
            torch.mm(a, b)  # (each product freed at once, as before)

    _, dt = timed(gemms, device)
    return 2 * n**3 * reps / dt / 1e9


def build_strategy(spec: RunSpec, mesh, device: torch.device, overlap: bool | None = None):
    """The spec's strategy on ``mesh`` (``overlap`` overrides the spec's, for the benchmark);
    with pipeline stages, this rank's stages of it behind the spec's schedule."""
    pp = spec.layout.pp

    def build(stage: Stage | None) -> Strategy:
        return get_strategy(spec.strategy)(
            spec.cfg,
            mesh,
            seed=spec.seed,
            dtype=DTYPES[spec.dtype],
            device=device,
            recompute=spec.recompute,
            # the keys are the strategy's declared options, never dp_bucket_mb (a float)
            **{**spec.options, **({} if overlap is None else {"overlap": overlap})},  # type: ignore[arg-type]
            stage=stage,
        )

    if pp == 1:
        return build(None)
    count = pp * stages_per_rank(spec.pp_schedule)
    here = stage_indices(spec.pp_schedule, pp, mesh[Axis.PP].rank)
    strats = [build(Stage.of(spec.cfg, count, i)) for i in here]
    return Pipelined(strats, mesh, spec.pp_schedule, spec.microbatches, spec.train)


def measure_rank(spec: RunSpec, device: torch.device, beat=lambda: None) -> dict[str, Any]:
    """Run the spec on this rank; return this rank's measurements (collective).

    ``beat()`` is called after every phase and step: the guard's proof of progress.
    """
    mesh = build_mesh(spec.mesh_dims)
    strat = build_strategy(spec, mesh, device)
    tokens, labels = make_batch(spec.cfg, spec.batch * spec.layout.dp, spec.seq_len, spec.seed)
    batch = strat.shard_batch(tokens, labels)
    train = spec.mode == "train"
    opt = AdamW(strat.parameters()) if train else None
    rank0 = dist.get_rank() == 0
    beat()
    startup = process_age_s()  # joined, built and sharded: the first step starts now
    count = [0]
    routed: list[list[int]] = []

    def step() -> tuple[torch.Tensor, torch.Tensor | None]:
        inject(dist.get_rank(), count[0], spec.seq_len, spec.strategy, strat.parameters())
        count[0] += 1
        beat()
        with stretched(dist.get_rank(), spec.seq_len, spec.strategy):
            loss, gnorm = one_step(strat, batch, opt)
        if count[0] == 1 and getattr(strat, "routed", None) is not None:  # experts: the
            routed.append([int(n) for n in strat.routed.tolist()])  # first step's, as the loss
        beat()
        return loss, gnorm

    tracker = MemoryTracker(limit=spec.max_memory)
    found, (loss, gnorm) = probe(step, strat, batch, opt, device, tracker=tracker)
    out: dict[str, Any] = {
        **found,
        "loss": float(loss),
        "grad_norm": None if gnorm is None else float(gnorm),
        "param_numel": strat.local_numel(),
        "optimizer_numel": opt.state_numel() if opt else 0,
        "startup_s": startup,
    }
    if routed:  # experts: the first step's rows per expert
        out["routed"] = routed[0]
    if not spec.quiet and rank0:
        print(f"[tspbench] probe steps: loss {out['loss']:.6f}", flush=True)

    for i in range(spec.warmup):  # the first: where the steady peak's parts are taken
        if i == 0:
            peak = found["tracked_peak"]
            out["crest_parts"] = crest_parts(step, tracker, strat, batch, opt, peak)
        else:
            step()
        if not spec.quiet and rank0:
            print(f"[tspbench] warmup {i + 1}/{spec.warmup}", flush=True)

    mesh.counter.reset()
    calib = []
    times = []
    pp_times = []  # a pipeline's (schedule, stage compute) seconds in each timed step
    for i in range(spec.steps):
        calib.append(gemm_rate(device, DTYPES[spec.dtype]))
        with blocked_in_collective():
            dist.barrier()
        if isinstance(strat, Pipelined):
            strat.take_times()
        _, dt = timed(step, device)
        times.append(dt)
        if isinstance(strat, Pipelined):
            pp_times.append(strat.take_times())
        if not spec.quiet and rank0:
            print(f"[tspbench] step {i + 1}/{spec.steps}: {dt * 1e3:.1f} ms (rank 0)", flush=True)
    with blocked_in_collective():  # a step lasts as long as its slowest rank
        out["step_times"] = slowest(times, device)
    out["calib_gflops"] = statistics.median(calib)
    k = spec.steps
    # (a pipeline's sends between stages: their own column, comm_bytes_pp_per_rank)
    axes = tuple(a for a in mesh.dims if a != Axis.PP) if spec.layout.pp > 1 else None
    out["comm_by_kind"] = {kind: b / k for kind, b in mesh.counter.by_kind(axes).items()}
    out["comm_by_axis"] = {axis: b / k for axis, b in mesh.counter.by_axis().items()}
    if isinstance(strat, Pipelined):
        out["pp_stage"], out["pp_times"] = strat.stage.index, pp_times
    return out


def at_rest(strat, batch, opt) -> list:
    """What lives between steps: parameters, fp32 masters, AdamW's moments once they exist, the
    batch (gradients are dropped by ``zero_grad``)."""
    state = [t for s in opt.inner.state.values() for t in s.values()] if opt else []
    return [strat.parameters(), opt.masters if opt else [], state, batch.tokens, batch.labels]


# the parts of a peak (:func:`crest_parts`), in the order the figures stack them
PARTS = ("weights", "gradients", "optimizer state", "inputs", STAGING, REST)


def part_column(part: str) -> str:
    """The summary table's column of a part of the peak (``peak_weights_bytes``, ...)."""
    return f"peak_{part.replace(' ', '_')}_bytes"


def crest_parts(
    step, tracker: MemoryTracker, strat, batch, opt, crest: int
) -> dict[str, int] | None:  # fmt: skip
    """What is live at a step's crest, by part: weights, gradients (what ``.grad`` holds then),
    optimizer state (AdamW's moments, fp32 masters), inputs, collective staging, and the rest:
    activations and temporaries (a gathered weight, a gradient still in a strategy's buffer).
    ``step()`` runs under the probe's ``tracker`` (it knows what the earlier steps left alive:
    a strategy's cached tables), which takes the parts when its live bytes first reach
    ``crest``, the steady-state probe's peak, which the steps repeat to the byte; None where
    this step never reaches it. The split of torch's ``MemTracker``, with this suite's tracker,
    which sees what every strategy's collectives stage."""
    parts: dict[str, int] = {}
    params = strat.parameters()

    def take() -> None:
        parts.update(tracker.live_by({
            "weights": params,
            "gradients": [p.grad for p in params if p.grad is not None],
            "optimizer state": at_rest(strat, batch, opt)[1:3],
            "inputs": [batch.tokens, batch.labels],
        }))  # fmt: skip

    tracker.crest(crest, take)
    with gc_held(), tracker:
        step()
    return parts or None


def probe(
    step, strat, batch, opt, device: torch.device, limit: int | None = None, also=None,
    fake: bool = False, tracker: MemoryTracker | None = None,
) -> tuple[dict, tuple]:  # fmt: skip
    """Peak memory of the first and of a steady-state step, then FLOPs in a step of their own.

    ``step()`` runs one step and returns (loss, gradient norm), which are returned as the
    first step gave them, beside the measurements (tensors: fake ones stay fake). The memory
    probes track what is at rest plus every tensor the steps create (a TorchDispatchMode that
    only records storages: it changes no kernel); on CUDA the allocator's peak of the same step
    is read as well. Where only the tracker measures (``fake`` tensors, and every device but
    CUDA) the FLOP counter (with ``also``, another counting mode, beside it) runs in the
    steady-state step *beneath* the tracker (entered first): the temporaries of the kernels it
    decomposes never reach the tracker, which sees exactly the ops of a step without it. On
    CUDA the allocator would see them, so the counter runs alone in a third step. Either way
    the mesh's byte counter then holds that one step's bytes. Collective: every rank runs the
    same steps."""
    peaks, unstaged, device_peaks, reserved = [], [], [], []
    first = None
    # one tracker across both steps: whatever the first step leaves alive (AdamW's moments, a
    # strategy's cached tables) is still counted in the second (``tracker``: the caller's, to
    # follow later steps too)
    tracker = tracker or MemoryTracker(limit=limit)
    tracker.track(*at_rest(strat, batch, opt))
    flops = counter()
    beneath = fake or device.type != "cuda"  # no allocator peak the counter could move
    for i in range(2):
        tracker.reset_peak()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        counting = beneath and i == 1
        if counting:
            strat.mesh.counter.reset()
        with gc_held(), flops if counting else nullcontext(), tracker:
            with also if counting and also else nullcontext():
                result = step()
        if first is None:  # copied outside the tracker, so the second step does not count it
            first = tuple(None if t is None else t.detach().clone() for t in result)
        del result
        peaks.append(tracker.peak)
        unstaged.append(tracker.peak_unstaged)
        if device.type == "cuda":
            device_peaks.append(torch.cuda.max_memory_allocated(device))
            reserved.append(torch.cuda.max_memory_reserved(device))
    del tracker
    if not beneath:
        strat.mesh.counter.reset()
        with gc_held(), flops, also or nullcontext():
            step()
    out = {
        "flops": flops.model_flops(),
        "flops_executed": int(flops.get_total_flops()),
        "tracked_peak_first": peaks[0],
        "tracked_peak": peaks[1],
        # without the collective backend's staging buffers (:func:`~tspbench.core.memory.charge`):
        # the same step's peaks on NCCL, which stages none in torch's allocator
        "tracked_peak_unstaged_first": unstaged[0],
        "tracked_peak_unstaged": unstaged[1],
    }
    if device.type == "cuda":
        out.update(device_peak_first=device_peaks[0], device_peak=device_peaks[1])
        out["device_reserved"] = max(reserved)
    assert first is not None  # the first of the two steps set it
    return out, first


def summarize(spec: RunSpec, ranks: list[dict[str, Any]], device_peak_flops: float | None) -> dict:
    """The measurement part of the record, from every rank's results (rank order): the keys of
    :data:`~tspbench.runtime.record_keys.RUN_SUMMARY`, in its order."""
    r0 = ranks[0]
    peaks = [r.get("device_peak", r["tracked_peak"]) for r in ranks]
    top = max(range(len(ranks)), key=peaks.__getitem__)
    firsts = [r.get("device_peak_first", r["tracked_peak_first"]) for r in ranks]
    times = r0["step_times"]
    step_time = statistics.median(times)
    tokens = spec.batch * spec.layout.dp * spec.seq_len
    flops = sum(r["flops"] for r in ranks)
    world = len(ranks)
    # the traffic of one model-group position: rank 0's, and with pipeline stages the sum over
    # its peers in every stage (each stage's layers, the head's collectives on the last)
    line = [s * (world // spec.layout.pp) for s in range(spec.layout.pp)]
    comm = _summed([ranks[r]["comm_by_kind"] for r in line])
    by_axis = _summed([ranks[r]["comm_by_axis"] for r in line])
    values = {
        "peak_mem_bytes": max(peaks),
        "peak_mem_bytes_per_rank": peaks,
        "peak_mem_bytes_first_step": max(firsts),
        "peak_mem_bytes_first_step_per_rank": firsts,
        "peak_mem_source": "cuda_max_memory_allocated" if "device_peak" in r0 else "tracked",
        "peak_parts_bytes": ranks[top].get("crest_parts"),
        "peak_reserved_bytes_per_rank": [r["device_reserved"] for r in ranks]
        if "device_reserved" in r0
        else None,
        "step_time_s": step_time,
        "step_time_min_s": min(times),
        "step_time_max_s": max(times),
        "step_times_s": times,
        "tokens_per_s": tokens / step_time,
        "comm_bytes": comm,
        "comm_bytes_total": sum(comm.values()),
        "comm_bytes_model_group": sum(b for a, b in by_axis.items() if a not in ("dp", "pp")),
        "comm_bytes_dp": by_axis.get("dp", 0.0),
        "comm_bytes_per_rank": [sum(r["comm_by_kind"].values()) for r in ranks],
        "flops_counted": "model",
        "flops_per_step": flops,
        "flops_executed_per_step": sum(r["flops_executed"] for r in ranks),
        "flops_per_rank": [r["flops"] for r in ranks],
        "mfu": flops / (step_time * world * device_peak_flops) if device_peak_flops else None,
        "param_numel_per_rank": [r["param_numel"] for r in ranks],
        "optimizer_numel_per_rank": [r["optimizer_numel"] for r in ranks],
        "loss": r0["loss"],
        "grad_norm": r0["grad_norm"],
        "calib_gflops": statistics.median(r["calib_gflops"] for r in ranks),
        "startup_s": max(r["startup_s"] for r in ranks),
        "tokens_per_s_per_gflops": tokens
        / step_time
        / statistics.median(r["calib_gflops"] for r in ranks),
    }
    out = ordered(RUN_SUMMARY, values)
    if spec.cfg.moe:
        out.update(moe_summary(ranks))
    return out if spec.layout.pp == 1 else {**out, **pipeline_summary(spec, ranks)}


def moe_summary(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """A run with experts: the first step's top-k assignments per expert over the global batch
    and every layer (each rank routes its own tokens), and the load imbalance, the busiest
    expert's rows over the mean (1: balanced; dropless, so the busiest expert's work sets
    the pace of an expert-parallel step)."""
    per = [sum(col) for col in zip(*(r["routed"] for r in ranks))]
    mean = sum(per) / len(per)
    values = {"tokens_per_expert": per, "expert_load_imbalance": max(per) / mean if mean else 1.0}
    return ordered(MOE_SUMMARY, values)


def _summed(dicts: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


def pipeline_summary(spec: RunSpec, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """A pipelined run's own measurements: each rank's stage, the time its schedule ran and
    its stage computed in it (medians over the timed steps), its bubble, the idle fraction of
    the pipeline's schedule (the longest rank's: the first stage's, which waits for the last
    backward; the last stage's own ends before the others' backwards do), beside the closed
    form's, and the bytes it sends between stages per step (a tied embedding's all-reduce
    between the two ends included)."""
    sched = [statistics.median(t[0] for t in r["pp_times"]) for r in ranks]
    busy = [statistics.median(t[1] for t in r["pp_times"]) for r in ranks]
    values = {
        "pp_stage_per_rank": [r["pp_stage"] for r in ranks],
        "pp_schedule_s_per_rank": sched,
        "pp_busy_s_per_rank": busy,
        "pp_bubble_fraction_per_rank": [1.0 - b / max(sched) for b in busy],
        "pp_bubble_closed_form": bubble_closed_form(
            spec.layout.pp, spec.microbatches, spec.pp_schedule
        ),
        "comm_bytes_pp_per_rank": [r["comm_by_axis"].get("pp", 0.0) for r in ranks],
    }
    return ordered(PIPELINE_SUMMARY, values)
