"""``tspbench run`` on one rank of a launched job: join, measure, and (rank 0) write the record.

A failure on any rank becomes the record's ``status``: ``oom`` (the device's or the tracker's
out-of-memory error on some rank) or ``error`` with its message. The failing rank posts its cause
to the job's key-value store and leaves; its peers' collectives then fail, and rank 0 reads the
causes to name the root one. An OOM is a result, not a crash: every rank that knows of one exits 0.
"""

from __future__ import annotations

import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist

from tspbench.cli import record_header
from tspbench.core.config import ConfigError
from tspbench.flops import device_peak
from tspbench.launch import RankEnv, detect, free_port, init
from tspbench.layout import rank_layout
from tspbench.measure import RunSpec, measure_rank, summarize
from tspbench.record import git_commit, hardware, utc_now, versions, write_json

FAIL_KEY = "tspbench/fail/{}"


def _classify(e: BaseException) -> str:
    oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
    return "oom" if oom else "error"


def _post(status: str, msg: str) -> None:
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(FAIL_KEY.format(dist.get_rank()), f"{status}\t{msg}")
    except Exception:  # the store may be gone with rank 0: nothing more to tell
        pass


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


def _measure(spec: RunSpec, device: torch.device, header: dict) -> dict | None:
    """`tspbench run`: measure on every rank, summarise on rank 0."""
    mine = measure_rank(spec, device)
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
        "model_group": {
            "size": len(lay.model_groups[0]),
            "axes": lay.axes,
            "groups": lay.model_groups,
        },
        "rank_nodes": nodes,
        "model_group_spans_nodes": bool(spans),
    }


def run_env(spec: RunSpec, out: str, timeout_s: float, work=_measure) -> int:
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
    device, backend = init(env, timeout_s)
    rank = env.rank
    header = record_header(spec, env.source, world)
    header.update(placement(spec, env))
    header.update(
        hardware=hardware(device, world), versions=versions(backend), git_commit=git_commit()
    )
    status, record = "ok", None
    try:
        result = work(spec, device, header)
        if rank == 0:
            record = {**header, "status": "ok", **result}
    except Exception as e:
        status, msg = _classify(e), f"{type(e).__name__}: {e}".strip()
        if not spec.quiet:
            traceback.print_exc()
        _post(status, msg)
        if rank != 0:
            oom = status == "oom" or any(s == "oom" for s, _ in _causes(world, 1.0).values())
            sys.stdout.flush()
            return 0 if oom else 1
        causes = _causes(world)
        root = next((c for c in causes.values() if c[0] == "oom"), causes.get(0, (status, msg)))
        status = root[0]
        record = {
            **header,
            "status": status,
            "error_message": root[1],
            "failed_ranks": sorted(causes),
        }
    if rank == 0:
        record["timestamp_utc"] = utc_now()
        write_json(out, record)
        if not spec.quiet:
            print(f"[tspbench] {status}: wrote {out}", flush=True)
    if status == "ok":
        dist.barrier()
        dist.destroy_process_group()
    return 0 if status in ("ok", "oom") else 1
