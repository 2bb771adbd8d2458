"""``tspbench run`` on one rank of a launched job: join, measure, and (rank 0) write the record.

A failure on any rank becomes the record's ``status``: ``oom`` (the device's or the tracker's
out-of-memory error on some rank) or ``error`` with its message. The failing rank posts its cause
to the job's key-value store and leaves; its peers' collectives then fail (at once when the peer
is gone, else after ``--timeout``), and rank 0 reads the causes to name the root one. An OOM is
a result, not a crash: every rank that knows of one exits 0. A signal (SIGINT, SIGTERM) or a hang
(no progress for ``--timeout`` s) is caught by :class:`tspbench.runtime.guard.Guard`, which
writes an ``error`` record saying so and exits. Exactly one record is written, atomically, by
rank 0.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from tspbench.core.config import ConfigError
from tspbench.runtime.flops import device_peak
from tspbench.runtime.guard import Guard
from tspbench.runtime.launch import RankEnv, detect, free_port, init
from tspbench.runtime.layout import rank_layout
from tspbench.runtime.measure import measure_rank, summarize
from tspbench.runtime.record import git_commit, hardware, utc_now, versions, write_json
from tspbench.runtime.spec import RunSpec

FAIL_KEY = "tspbench/fail/{}"


def _classify(e: BaseException) -> str:
    oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
    return "oom" if oom else "error"


def _post(status: str, msg: str, wait_s: float = 2.0) -> None:
    """Tell the peers why this rank stopped (best effort: the store may be gone with rank 0)."""

    def post() -> None:
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(FAIL_KEY.format(dist.get_rank()), f"{status}\t{msg}")
        except Exception:
            pass

    t = threading.Thread(target=post, daemon=True)
    t.start()
    t.join(wait_s)


def _causes(world: int, wait_s: float = 3.0) -> dict[int, tuple[str, str]]:
    """Failure causes posted by any rank (waits briefly for the root cause to land)."""
    store = dist.distributed_c10d._get_default_store()
    found: dict[int, tuple[str, str]] = {}
    deadline = time.monotonic() + wait_s
    while True:
        for r in range(world):
            key = FAIL_KEY.format(r)
            if r not in found and store.check([key]):
                status, msg = store.get(key).decode().split("\t", 1)
                found[r] = (status, msg)
        if any(s == "oom" for s, _ in found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


CONSEQUENCES = ("connection closed", "connection reset")  # a peer went away: never the cause
HANGS = ("no progress for", "timed out", "timeout")  # a rank stalled: the cause if nothing else


def root_cause(causes: dict[int, tuple[str, str]], own: tuple[str, str]) -> tuple[str, str]:
    """The failure that started it: an OOM anywhere, else the first real error, else the first
    hang (a stalled rank's watchdog), else this rank's own (typically a closed connection)."""
    ordered = [c for _, c in sorted(causes.items())]

    def tier(cause: tuple[str, str]) -> int:
        msg = cause[1].lower()
        if cause[0] == "oom":
            return 0
        if any(s in msg for s in CONSEQUENCES):
            return 3
        return 2 if any(s in msg for s in HANGS) else 1

    return min(ordered + [own], key=tier)


def _measure(spec: RunSpec, device: torch.device, header: dict, beat) -> dict | None:
    """`tspbench run`: measure on every rank, summarise on rank 0."""
    mine = measure_rank(spec, device, beat)
    gathered = [None] * spec.layout.world_size if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    peak = device_peak(header["hardware"]["device_name"]) if device.type == "cuda" else None
    return summarize(spec, gathered, peak)


def placement(spec: RunSpec, env: RankEnv) -> dict:
    """Model groups, the node of every rank, and whether a model group spans nodes (collective)."""
    hosts = [None] * env.world_size
    dist.all_gather_object(hosts, socket.gethostname())
    lay = rank_layout(spec.strategy, spec.layout)
    nodes: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        nodes.setdefault(h, []).append(r)
    spans = [g for g in lay.model_groups if len({hosts[r] for r in g}) > 1]
    lws = env.local_world_size
    size = len(lay.model_groups[0])
    predicted = bool(lws) and lws < env.world_size and lws % size != 0
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


def run_env(
    spec: RunSpec, out: str, timeout_s: float, work=_measure, time_limit_s: float | None = None
) -> int:
    """Join the launched job, run ``work`` (collective), and write rank 0's record."""
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
            f"world size {env.world_size} (from {env.source}): must equal degree x dp = {world}"
        )
    header = spec.header(env.source, world)
    lock, written = threading.Lock(), []

    def write(record: dict) -> None:
        with lock:
            if written or env.rank != 0:
                return
            written.append(True)
            write_json(out, {**record, "timestamp_utc": utc_now()})
            if not spec.quiet:
                print(f"[tspbench] {record['status']}: wrote {out}", flush=True)

    def on_fatal(reason: str) -> None:
        print(f"[tspbench] rank {env.rank}: {reason}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            _post("error", reason)
        write({**header, "status": "error", "error_message": reason, "failed_ranks": [env.rank]})

    guard = Guard(timeout_s, on_fatal, time_limit_s)
    device, backend = init(env, timeout_s)
    guard.beat()
    header.update(placement(spec, env))
    header.update(
        hardware=hardware(device, world), versions=versions(backend), git_commit=git_commit()
    )
    status = "ok"
    try:
        result = work(spec, device, header, guard.beat)
        if env.rank == 0:
            write({**header, "status": "ok", **result})
    except Exception as e:
        status, msg = _classify(e), f"{type(e).__name__}: {e}".strip()
        if not spec.quiet:
            traceback.print_exc()
        _post(status, msg)
        guard.beat()
        if env.rank != 0:
            oom = status == "oom" or any(s == "oom" for s, _ in _causes(world, 1.0).values())
            sys.stdout.flush()
            return 0 if oom else 1
        causes = _causes(world)
        root = root_cause(causes, (status, msg))
        status = root[0]
        write(
            {**header, "status": status, "error_message": root[1], "failed_ranks": sorted(causes)}
        )
    guard.beat()
    if status == "ok":
        dist.barrier()
        dist.destroy_process_group()
    return 0 if status in ("ok", "oom") else 1
