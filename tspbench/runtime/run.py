"""``tspbench run`` on one rank of a launched job: join, measure, and (rank 0) write the record.

A failure on any rank becomes the record's ``status``: ``oom`` (the device's or the tracker's
out-of-memory error on some rank) or ``error`` with its message; how the ranks agree on the root
cause is :mod:`tspbench.runtime.failure`. An OOM is a result, not a crash: every rank that knows
of one exits 0. A signal (SIGINT, SIGTERM) or a hang (no progress for ``--timeout`` s) is caught
by :class:`tspbench.runtime.guard.Guard`, which writes an ``error`` record saying so and exits.
Exactly one record is written, atomically, by rank 0."""

from __future__ import annotations

import math
import socket
import sys
import threading
import traceback
from typing import Any, cast

import torch
import torch.distributed as dist

from tspbench.core import attention
from tspbench.core.comm import blocked_in_collective
from tspbench.core.config import ConfigError
from tspbench.core.dtypes import DTYPES
from tspbench.runtime import failure
from tspbench.runtime.decode import measure_decode_rank, summarize_decode
from tspbench.runtime.flops import device_peak
from tspbench.runtime.guard import RENDEZVOUS, Guard, process_age_s
from tspbench.runtime.launch import RankEnv, detect, free_port, init
from tspbench.runtime.layout import rank_layout
from tspbench.runtime.measure import measure_rank, summarize
from tspbench.runtime.record import (
    git_commit,
    hardware,
    interrupted_path,
    record_written,
    utc_now,
    versions,
)
from tspbench.runtime.spec import RunSpec


def _measure(spec: RunSpec, device: torch.device, header: dict, beat) -> dict | None:
    """`tspbench run`: measure on every rank, summarise on rank 0."""
    mine = (measure_decode_rank if spec.decoding else measure_rank)(spec, device, beat)
    gathered = [None] * spec.layout.world_size if dist.get_rank() == 0 else None
    with blocked_in_collective():
        dist.gather_object(mine, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    ranks = cast(list[dict[str, Any]], gathered)  # gather_object filled every rank's slot
    bf16_gpu = device.type == "cuda" and spec.dtype == "bf16"  # the peaks are bf16's
    peak = device_peak(header["hardware"]["device_name"]) if bf16_gpu else None
    return (summarize_decode if spec.decoding else summarize)(spec, ranks, peak)


def placement(spec: RunSpec, env: RankEnv) -> dict:
    """Model groups, the node of every rank, and whether a model group spans nodes (collective)."""
    hosts = [""] * env.world_size  # every rank's host name, once gathered
    with blocked_in_collective():
        dist.all_gather_object(hosts, socket.gethostname())
    lay = rank_layout(spec.strategy, spec.layout)
    nodes: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        nodes.setdefault(h, []).append(r)
    spans = [g for g in lay.model_groups if len({hosts[r] for r in g}) > 1]
    lws = env.local_world_size
    size = len(lay.model_groups[0])
    predicted = bool(lws and lws < env.world_size and lws % size != 0)
    if env.rank == 0 and (spans or predicted):
        print(
            f"[tspbench] WARNING: model group of {size} ranks spans nodes "
            f"(ranks per node: {lws or 'unknown'}); its collectives cross the network",
            file=sys.stderr,
        )
    return {
        "model_group": {"size": size, "axes": lay.axes, "groups": lay.model_groups},
        "rank_nodes": nodes,
        "model_group_spans_nodes": bool(spans),
    }


def attention_kernel(spec: RunSpec, device: torch.device) -> str:
    """The attention kernel every strategy calls on ``device`` through the shared entry point
    (flash_attn, torch_flash, cpu_flash, sdpa)."""
    return attention.backend_for(device, DTYPES[spec.dtype])


def _require_causal_alignment(device: torch.device, spec: RunSpec) -> None:
    """Refuse a kernel whose causal mask is aligned top-left (some ROCm SDPA builds): one tiny
    call per device and dtype, before any step, rather than records of wrong attention."""
    problem = attention.causal_alignment_problem(device, DTYPES[spec.dtype])
    if problem:
        raise ConfigError(problem)


def _finite(record: dict) -> dict:
    """A record that strict JSON parsers accept: a non-finite loss or gradient norm makes an
    otherwise ``ok`` run an error (the numbers are not results), non-finite numbers become null."""
    bad = [k for k in ("loss", "grad_norm") if isinstance(record.get(k), float)]
    bad = [k for k in bad if not math.isfinite(record[k])]
    if bad and record.get("status") == "ok":
        what = ", ".join(f"{k} {record[k]}" for k in bad)
        record = {**record, "status": "error", "error_message": f"non-finite result: {what}"}

    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return [clean(x) for x in v] if isinstance(v, list) else v

    return clean(record)


def run_env(
    spec: RunSpec,
    out: str,
    timeout_s: float,
    work=_measure,
    time_limit_s: float | None = None,
    step_timeout_s: float = 3600.0,
    cell: bool = False,
    device_choice: str = "auto",
) -> int:
    """Join the launched job, run ``work`` (collective), and write rank 0's record (``cell``: a
    pipeline cell, whose interrupted record goes to :func:`interrupted_path`)."""
    env = _rank_env(spec)
    world = spec.layout.world_size
    header = spec.header(env.source, world)
    record = _Record(spec, out, cell, env, header)
    guard = Guard(timeout_s, record.on_fatal, time_limit_s, step_timeout_s)
    guard.rendezvous = f"{env.master_addr}:{env.master_port}"
    try:
        device, backend = init(env, timeout_s, device_choice)
    except Exception as e:  # never joined: no peer to tell, rank 0 says why
        reason = f"{RENDEZVOUS} at {guard.rendezvous} failed: {type(e).__name__}: {e}"
        record.write(
            {**header, "status": "error", "error_message": reason, "failed_ranks": [env.rank]}
        )
        print(f"[tspbench] rank {env.rank}: {reason}", file=sys.stderr, flush=True)
        return 1
    guard.rendezvous = None
    guard.beat()
    header.update(placement(spec, env))
    header.update(
        hardware=hardware(device, world),
        versions=versions(backend),
        git_commit=git_commit(),
        attention_backend=attention_kernel(spec, device),
    )
    status, completed, caught = "ok", False, None
    try:
        _require_causal_alignment(device, spec)
        result = work(spec, device, header, guard.beat)
        completed = True
        if env.rank == 0:
            status = record.write({**header, "status": "ok", **result})
    except Exception as e:
        caught = failure.classify(e), f"{type(e).__name__}: {e}".strip(), traceback.format_exc()
    # Out of the except block, the exception's frames, and the tensors they held, are freed: an
    # allocator failure leaves the memory (and address space) that reporting it needs.
    if caught is not None:
        return _report_failure(spec, env, record, guard, caught)
    guard.beat()
    if completed:  # every rank finished the work: leave together
        with blocked_in_collective():
            dist.barrier()
        dist.destroy_process_group()
    return 0 if status in ("ok", "oom") else 1


def _rank_env(spec: RunSpec) -> RankEnv:
    """This rank's place in the launched job (one rank of its own without a launcher), its
    world size the spec's."""
    env = detect()
    world = spec.layout.world_size
    if env is None:
        if world != 1:
            raise ConfigError(
                f"no launcher environment (torchrun, Slurm or MPI) for world size {world}; "
                f"launch with torchrun/srun/mpiexec, or use --launch local --nproc {world}"
            )
        env = RankEnv(0, 1, 0, "127.0.0.1", free_port(), "single")
    if env.world_size != world:
        raise ConfigError(
            f"world size {env.world_size} (from {env.source}): must equal degree x dp x pp "
            f"= {world}"
        )
    return env


class _Record:
    """Rank 0's one record (``header`` completed as the run goes): :meth:`write` writes it
    once, whoever calls first; :meth:`on_fatal` is the guard's answer to a signal or a hang."""

    def __init__(self, spec: RunSpec, out: str, cell: bool, env: RankEnv, header: dict) -> None:
        self.spec, self.out, self.cell, self.env, self.header = spec, out, cell, env, header
        self.lock = threading.Lock()
        self.written: list[bool] = []

    def write(self, record: dict) -> str:
        """Write rank 0's record once; return the status it was written with."""
        with self.lock:
            if self.written or self.env.rank != 0:
                return record["status"]
            self.written.append(True)
            interrupted = "interrupted by" in str(record.get("error_message"))
            path = interrupted_path(self.out) if self.cell and interrupted else self.out
            record = _finite({**record, "wall_s": process_age_s(), "timestamp_utc": utc_now()})
            if not record_written(path, record, "rank 0"):
                return "error"
            if dist.is_initialized():  # the peers waiting in _await_record may leave now
                try:
                    dist.distributed_c10d._get_default_store().set(failure.WRITTEN_KEY, "1")
                except Exception:
                    pass
            if not self.spec.quiet:
                print(f"[tspbench] {record['status']}: wrote {path}", flush=True)
            return record["status"]

    def on_fatal(self, reason: str) -> str:
        env, world = self.env, self.spec.layout.world_size
        print(f"[tspbench] rank {env.rank}: {reason}", file=sys.stderr, flush=True)
        own, failed, status = ("error", reason), [env.rank], "error"
        if dist.is_initialized():
            failure.post(*own)
            if env.rank != 0:
                failure.await_record()
            if env.rank == 0 and "interrupted by" not in reason:  # wait a watchdog tick more:
                causes = failure.causes(
                    world, wait_s=5.0, quiet_s=2.0
                )  # a silent rank is the suspect
                status, reason, failed = failure.root_cause(causes, own, world)
        # the root cause's status: a peer's OOM that left this rank waiting is an OOM
        self.write(
            {**self.header, "status": status, "error_message": reason, "failed_ranks": failed}
        )
        return status


def _report_failure(
    spec: RunSpec, env: RankEnv, record: _Record, guard: Guard, caught: tuple[str, str, str]
) -> int:
    """After ``work`` raised on this rank: post its cause; a peer leaves (0 if an OOM is the
    cause), rank 0 writes the root cause's record and exits."""
    world = spec.layout.world_size
    status, msg, tb = caught
    failure.post(status, msg, tb=tb)
    guard.beat()
    if not spec.quiet:  # one line per rank; the root cause's traceback once, from rank 0
        print(f"[tspbench] rank {env.rank}: {status}: {msg}", file=sys.stderr, flush=True)
    if env.rank != 0:
        oom = failure.leave(world, status)
        sys.stdout.flush()
        return 0 if oom else 1
    status, msg, failed = failure.root_cause(failure.causes(world), (status, msg), world)
    if not spec.quiet and failed:
        print(failure.traceback_of(failed[0], 0, tb), file=sys.stderr, end="", flush=True)
    record.write({**record.header, "status": status, "error_message": msg, "failed_ranks": failed})
    failure.exit_now(0 if status in ("ok", "oom") else 1)
