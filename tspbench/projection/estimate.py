"""Fake-tensor estimate: run the real strategy code for a step, at any world size, moving no data.

One process plays each rank in turn: torch's fake process group (backend ``fake``: every
collective, point-to-point included, completes at once and moves nothing) and ``FakeTensorMode``
(tensors have shapes, dtypes and storages but no data), with the same :class:`MemoryTracker`,
:class:`CommCounter` and FLOP counter as a measured run. So peak memory, bytes and FLOPs come from
the code that runs on the cluster, not from a second model of it.

Faithfulness notes:
- Attention: ``kernel="fused"`` shapes one flash call per block (out and lse, no [Lq, Lk] buffer):
  what flash-attn allocates on a GPU. ``cpu_flash`` is what real CPU runs use (prefix/diagonal
  split with an fp32 merge), for checking the estimate against them.
- Ranks: zigzag gives the ranks of a model group different key lengths, so each of the D ranks of
  replica 0 is estimated; data-parallel replicas run the same shapes (only their batch rows
  differ), so they are not estimated again.
- The steps are a measured run's probe steps (:func:`tspbench.runtime.measure.probe`): the first
  step's peak (AdamW creates its state inside it) and the steady-state peak of a second step,
  which decides whether a run fits; FLOPs are counted in the second step, the FLOP counter
  beneath the memory tracker so that it cannot move the peak. Dispatched operations are counted
  apart (:func:`count_rank_ops`): the same two steps without the trackers.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from tspbench.core import attention, moe
from tspbench.core.comm import emulating
from tspbench.core.memory import MemoryTracker
from tspbench.core.mesh import Axis, build_mesh
from tspbench.core.optim import AdamW
from tspbench.core.reference import make_batch
from tspbench.runtime.decode import generation, generation_bytes
from tspbench.runtime.flops import counter
from tspbench.runtime.measure import at_rest, build_strategy, gc_held, one_step, probe
from tspbench.runtime.registry import get_strategy
from tspbench.runtime.spec import RunSpec


class OpCounter(TorchDispatchMode):
    """Counts the operations that do work (views and metadata-only ops are free)."""

    FREE = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "select", "slice",
            "split", "split_with_sizes", "unbind", "as_strided", "alias", "detach", "unsqueeze",
            "squeeze", "unflatten", "lift_fresh", "lift_fresh_copy", "chunk"}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "aten" and name not in self.FREE:
            self.n += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def fake_rank(
    spec: RunSpec, rank: int, kernel: str | None = "fused", backend: str | None = None
) -> Iterator[tuple[Any, Any]]:
    """(mesh, strategy) of ``spec``'s rank ``rank`` on torch's fake process group, built under
    ``FakeTensorMode`` with the attention ``kernel`` forced (None: the device's own), counting
    the staging buffers of the process-group ``backend`` (``tspbench.core.comm.STAGED``; None:
    a CPU run's, gloo, with ``cpu_flash``, else NCCL's: none); the group is destroyed on exit,
    so one process can play every rank in turn."""
    if dist.is_initialized():
        raise RuntimeError("a fake rank needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=spec.layout.world_size)
    try:
        mesh = build_mesh(get_strategy(spec.strategy).mesh_dims(spec.layout))
        backend = backend or ("gloo" if kernel == "cpu_flash" else "nccl")
        with FakeTensorMode(), attention.forced(kernel), emulating(backend), moe.balanced():
            yield mesh, build_strategy(spec, mesh, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def count_rank_ops(spec: RunSpec) -> int:
    """Operations rank 0 dispatches in a (steady-state) step of ``spec``: a first step, then
    the second under the :class:`OpCounter` alone. The estimator's probe runs the same steps
    under its memory tracker and FLOP counter too; the counter sits above both (entered last),
    so they change no count (tests/unit/test_op_count.py) and are left out: a quarter of the
    time, which the planner spends on cold counts."""
    with fake_rank(spec, 0) as (_, strat):
        tokens, labels = make_batch(spec.cfg, spec.batch * spec.layout.dp, spec.seq_len, 0)
        batch = strat.shard_batch(tokens, labels)
        opt = AdamW(strat.parameters()) if spec.mode == "train" else None
        one_step(strat, batch, opt)  # AdamW's state and the strategy's tables are made
        ops = OpCounter()
        with ops:
            one_step(strat, batch, opt)
        return ops.n


def estimate_rank(
    spec: RunSpec, rank: int, kernel: str = "fused", backend: str | None = None
) -> dict[str, Any]:
    """Peak memory (first and steady step), FLOPs and bytes of one rank, on fake tensors
    (``kernel``, ``backend``: :func:`fake_rank`'s)."""
    with fake_rank(spec, rank, kernel, backend) as (mesh, strat):
        if spec.decoding:
            return {"rank": rank, **_decode_rank(spec, strat, mesh)}
        tokens, labels = make_batch(spec.cfg, spec.batch * spec.layout.dp, spec.seq_len, 0)
        batch = strat.shard_batch(tokens, labels)
        del tokens, labels
        train = spec.mode == "train"
        opt = AdamW(strat.parameters()) if train else None
        at_rest_bytes = MemoryTracker()
        at_rest_bytes.track(*at_rest(strat, batch, opt))
        found, _ = probe(  # as a measured run's probe steps
            lambda: one_step(strat, batch, opt), strat, batch, opt, torch.device("cpu"),
            fake=True,
        )  # fmt: skip
        return {
            "rank": rank,
            "at_rest_bytes": at_rest_bytes.live,
            "peak_first_bytes": found["tracked_peak_first"],
            "peak_bytes": found["tracked_peak"],
            "peak_first_bytes_unstaged": found["tracked_peak_unstaged_first"],
            "peak_bytes_unstaged": found["tracked_peak_unstaged"],
            "flops": found["flops"],
            "flops_executed": found["flops_executed"],
            "comm_by_kind": dict(mesh.counter.by_kind()),
            "comm_by_axis": dict(mesh.counter.by_axis()),
            "param_numel": strat.local_numel(),
            "optimizer_numel": opt.state_numel() if opt else 0,
        }


def _decode_rank(spec: RunSpec, strat, mesh) -> dict[str, Any]:
    """One generation as a measured decode run's probe (:mod:`tspbench.runtime.decode`), its
    FLOP counter beneath the memory tracker (entered first, so it cannot move the peak). Bytes
    and FLOPs are the record's: per decode step for ``decode``, per generation for
    ``generate``. Operations are not counted: decode steps are charged no dispatch, and a
    generation's prefill is counted as the forward pass it is (``decode.prefill_spec``)."""
    tokens, _ = make_batch(spec.cfg, spec.batch, spec.seq_len, spec.seed)
    n = spec.new_tokens
    tracker = MemoryTracker()
    tracker.track(strat.parameters(), tokens)
    at_rest_bytes = tracker.live
    flops = counter()
    with torch.no_grad(), gc_held(), flops, tracker:
        g = generation(strat, tokens, n, torch.device("cpu"), mesh, flops)
    prefill_b, decode_b = g["prefill_bytes"], {k: b / (n - 1) for k, b in g["decode_bytes"].items()}
    decode_flops = (int(flops.get_total_flops()) - g["prefill_flops"]) / (n - 1)
    if spec.mode == "decode":
        comm, step_flops = decode_b, decode_flops
    else:
        comm = generation_bytes(prefill_b, decode_b, n)
        step_flops = g["prefill_flops"] + (n - 1) * decode_flops
    return {
        "at_rest_bytes": at_rest_bytes,
        "peak_first_bytes": tracker.peak,
        "peak_bytes": tracker.peak,
        "peak_first_bytes_unstaged": tracker.peak_unstaged,
        "peak_bytes_unstaged": tracker.peak_unstaged,
        "flops": int(step_flops),
        "flops_executed": int(step_flops),  # generation recomputes nothing
        "comm_by_kind": comm,
        "comm_by_axis": {},
        "param_numel": strat.local_numel(),
        "optimizer_numel": 0,
        "kv_cache_bytes": g["cache"].nbytes(),
        "prefill_bytes": sum(prefill_b.values()),
        "decode_bytes_per_token": sum(decode_b.values()),
        "prefill_flops": g["prefill_flops"],
        "decode_flops": decode_flops,
    }


def estimate(
    spec: RunSpec, ranks: list[int] | None = None, kernel: str = "fused",
    backend: str | None = None,
) -> dict:  # fmt: skip
    """Estimate every rank of replica 0 (or ``ranks``); the record's measurement part
    (``kernel``, ``backend``: :func:`fake_rank`'s)."""
    t0 = time.perf_counter()
    ranks = list(range(spec.layout.degree)) if ranks is None else ranks
    per = [estimate_rank(spec, r, kernel, backend) for r in ranks]
    worst = max(per, key=lambda p: p["peak_bytes"])
    out = {
        "estimated_ranks": ranks,
        "kernel": kernel,
        "peak_mem_bytes": worst["peak_bytes"],
        "peak_mem_bytes_first_step": max(p["peak_first_bytes"] for p in per),
        "peak_mem_bytes_per_rank": [p["peak_bytes"] for p in per],
        "at_rest_bytes_per_rank": [p["at_rest_bytes"] for p in per],
        "flops_per_rank": [p["flops"] for p in per],  # model FLOPs, as a record's
        "flops_executed_per_rank": [p["flops_executed"] for p in per],
        "comm_bytes": per[0]["comm_by_kind"],
        "comm_bytes_total": sum(per[0]["comm_by_kind"].values()),
        "comm_bytes_dp": per[0]["comm_by_axis"].get(Axis.DP, 0.0),
        "comm_bytes_per_rank": [sum(p["comm_by_kind"].values()) for p in per],
        "param_numel_per_rank": [p["param_numel"] for p in per],
        "optimizer_numel_per_rank": [p["optimizer_numel"] for p in per],
        "estimate_s": time.perf_counter() - t0,
    }
    if spec.decoding:  # the decode record's fields (docs/decode.md)
        out.update(
            kv_cache_bytes=max(p["kv_cache_bytes"] for p in per),
            kv_cache_bytes_per_rank=[p["kv_cache_bytes"] for p in per],
            decode_bytes_per_token=per[0]["decode_bytes_per_token"],
            decode_bytes_per_token_per_rank=[p["decode_bytes_per_token"] for p in per],
            prefill_comm_bytes=per[0]["prefill_bytes"],
        )
    return out
