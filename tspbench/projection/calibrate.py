"""``tspbench calibrate``: microbenchmark the machine at hand into a hardware preset.

For each rank count P (ranks sharing one node, as the runs will), P processes measure at the
same time: the GEMM rate, the causal attention kernel's rate, the memory bandwidth of an
elementwise copy, the per-operation dispatch overhead (a small autograd workload timed and
divided by the operations it dispatches), each collective's latency and bandwidth (a least-squares
fit of time = latency + bus bytes / bandwidth over several sizes, bus bytes as the counter counts
them), and how much of an in-flight collective hides behind a GEMM. Rates are per rank, so
oversubscribed CPUs (more ranks than cores) are measured as such.
"""

from __future__ import annotations

import os
import platform
import statistics
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tspbench.core.comm import KINDS, Comm, CommCounter, bus_bytes
from tspbench.core.dtypes import DTYPES
from tspbench.runtime.timing import timed

SIZES = (2**12, 2**15, 2**18, 2**21)  # bytes per collective


def _timed(fn, device: torch.device, reps: int, inner: int = 1) -> float:
    """Median seconds per call of ``fn`` over ``reps`` windows of ``inner`` calls, all ranks
    starting each window together (windows long enough that ranks really run concurrently)."""
    times = []
    for _ in range(reps):
        if dist.is_initialized():
            dist.barrier()

        def window() -> None:
            for _ in range(inner):
                fn()  # (each result freed at once)

        times.append(timed(window, device)[1] / inner)
    return statistics.median(times)


def _compute(device: torch.device, dtype: torch.dtype) -> dict[str, float | dict[str, float]]:
    from tspbench.core.attention import causal_fwd
    from tspbench.projection.estimate import OpCounter

    # GEMM rate by size (square n x n x n) and attention rate by head dim: small shapes run far
    # below the peak, so the projection picks the rate of the model's own shapes
    sizes = (1024, 2048, 4096, 8192) if device.type == "cuda" else (64, 128, 256, 512, 1024)
    gemm = {}
    for n in sizes:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        reps = max(1, int(2e8 / n**3)) if device.type == "cpu" else 20
        gemm[str(n)] = 2 * n**3 / _timed(lambda a=a, b=b: torch.mm(a, b), device, 5, reps)
    L, H = (4096, 32) if device.type == "cuda" else (1024, 8)
    attn = {}
    for d in (8, 16, 32, 64, 128):
        q, k, v = (torch.randn(1, H, L, d, device=device, dtype=dtype) for _ in range(3))
        flops = 4 * H * d * L * (L + 1) / 2  # causal: the counter's pairs
        attn[str(d)] = flops / _timed(lambda q=q, k=k, v=v: causal_fwd(q, k, v), device, 5, 3)
    x = torch.empty(2**22, device=device, dtype=torch.float32)
    y = torch.empty_like(x)
    membw = 2 * x.numel() * 4 / _timed(lambda: y.copy_(x), device, 7, 5)
    # dispatch overhead: a training step of the tiny reference model on a few tokens (the code
    # paths of real runs: autograd, Python, AdamW), whose compute is negligible, per operation
    from tspbench.core.config import get_config
    from tspbench.core.optim import AdamW
    from tspbench.core.reference import ReferenceModel, make_batch

    cfg = get_config("tiny")
    model = ReferenceModel(cfg, dtype=dtype, device=device)
    opt = AdamW(list(model.parameters()))
    tokens, labels = (t.to(device) for t in make_batch(cfg, 1, 16, 0))

    def small() -> None:
        model.loss(tokens, labels)[0].backward()
        opt.step()
        opt.zero_grad()

    small()  # AdamW state
    counter = OpCounter()
    with counter:
        small()
    overhead = _timed(small, device, 7, 3) / counter.n
    return {
        "gemm_flops_by_n": gemm,
        "attention_flops_by_d": attn,
        "memory_bandwidth": membw,
        "op_overhead_s": overhead,
    }


def _fit(points: list[tuple[float, float]]) -> dict[str, float]:
    """Least squares t = lat + x / bw over (bus bytes x, seconds t)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    mt = sum(t for _, t in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (t - mt) for x, t in points) / sxx if sxx else 0.0
    slope = max(slope, 1e-15)
    return {"lat": max(mt - slope * mx, 0.0), "bw": 1.0 / slope}


def _collectives(device: torch.device, size: int) -> dict[str, Any]:
    """Fits per collective kind for groups of ``size`` consecutive ranks, all groups at once
    (as a mesh's groups run: e.g. TP+SP's pairs while the other pairs communicate too)."""
    world = dist.get_world_size()
    lines = [list(range(i, i + size)) for i in range(0, world, size)]
    group = dist.group.WORLD if size == world else dist.new_subgroups_by_enumeration(lines)[0]
    ranks = next(line for line in lines if dist.get_rank() in line)
    comm = Comm(group, ranks, "model", CommCounter())
    out: dict[str, Any] = {}
    for kind in KINDS:
        pts = []
        for nbytes in SIZES:
            t = torch.zeros(nbytes // 4, device=device)
            full = torch.zeros(nbytes // 4 * comm.size, device=device)
            op = {
                "all_gather": lambda t=t: comm.all_gather(t, dim=0),
                "reduce_scatter": lambda full=full: comm.reduce_scatter(full, dim=0),
                "all_reduce": lambda t=t: comm.all_reduce(t),
                "broadcast": lambda t=t: comm.broadcast(t, src=0),
                "reduce": lambda t=t: comm.reduce(t, dst=0),
                "send_recv": lambda t=t: comm.ring_exchange(t, torch.empty_like(t)),
                "all_to_all": lambda full=full: comm.all_to_all(full),  # D equal blocks
            }[kind]
            split = ("all_gather", "reduce_scatter", "all_to_all")
            full_bytes = nbytes * (comm.size if kind in split else 1)
            pts.append((bus_bytes(kind, full_bytes, comm.size), _timed(op, device, 7)))
        out[kind] = _fit(pts)
    return out


def _straggler(device: torch.device, dtype: torch.dtype) -> float:
    """Slowest rank's time over the mean rank's for the same work started together: a step
    lasts as long as its slowest rank, so compute and dispatch are scaled by this."""
    n = 1024 if device.type == "cuda" else 128
    a = torch.randn(n, n, device=device, dtype=dtype)
    ratios = []
    for _ in range(9):
        dist.barrier()

        def work() -> None:
            for _ in range(50):
                torch.mm(a, a).relu_()

        t = torch.tensor([timed(work, device)[1]], dtype=torch.float64, device=device)
        each = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(each, t)
        ts = torch.cat(each)
        ratios.append(float(ts.max() / ts.mean()))
    return statistics.median(ratios)


def _overlap(device: torch.device, dtype: torch.dtype) -> float:
    """Fraction of an all-reduce that hides behind concurrent GEMMs (0: none, 1: all)."""
    n = 1024 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=dtype)
    t = torch.zeros(2**20, device=device)

    def gemms() -> None:
        for _ in range(8):
            torch.mm(a, a)

    tc = _timed(gemms, device, 5)
    tm = _timed(lambda: dist.all_reduce(t), device, 5)

    def both() -> None:
        w = dist.all_reduce(t, async_op=True)
        gemms()
        w.wait()

    tb = _timed(both, device, 5)
    return min(max((tc + tm - tb) / min(tc, tm), 0.0), 1.0)


def _worker(rank: int, world: int, port: int, device_type: str, dtype_name: str, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the threads a launched rank gets (tspbench.runtime.launch.init): the cores shared out
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dtype = DTYPES[dtype_name]
    try:
        res: dict[str, Any] = _compute(device, dtype)
        if world > 1:
            res.update(_collectives(device, world))
            sizes = [g for g in range(2, world) if world % g == 0]
            res["groups"] = {str(g): _collectives(device, g) for g in sizes}
            res["overlap_efficiency"] = _overlap(device, dtype)
            res["straggler"] = _straggler(device, dtype)
        q.put((rank, res))
    finally:
        dist.destroy_process_group()


def measure(ranks: int, device_type: str, dtype: str) -> dict[str, Any]:
    """Rates per rank with ``ranks`` processes measuring at once (medians over the ranks)."""
    from tspbench.runtime.launch import free_port

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = free_port()
    mp.start_processes(
        _worker, args=(ranks, port, device_type, dtype, q), nprocs=ranks, start_method="spawn"
    )
    results = dict(q.get() for _ in range(ranks))
    keys = results[0].keys()
    out: dict[str, Any] = {}
    for k in keys:
        vals = [results[r][k] for r in range(ranks)]
        if k == "groups":  # {group size: {kind: fit}}
            out[k] = {
                g: {kind: {f: statistics.median(v[g][kind][f] for v in vals) for f in ("lat", "bw")}
                    for kind in vals[0][g]}
                for g in vals[0]
            }  # fmt: skip
        elif isinstance(vals[0], dict):  # a fit or a rate table: median per entry
            out[k] = {f: statistics.median(v[f] for v in vals) for f in vals[0]}
        else:
            out[k] = statistics.median(vals)
    if ranks == 1:  # nothing to communicate with: collectives cost their dispatch only
        out.update({k: {"lat": 0.0, "bw": 1e30} for k in KINDS})  # (finite: strict JSON)
        out["overlap_efficiency"] = 0.0
        out["straggler"] = 1.0
    out["inter"] = out["all_reduce"]  # one machine: no NIC to model
    return out


def calibrate(ranks: list[int], device_type: str, dtype: str) -> dict[str, Any]:
    """A preset: rates per rank count, with the machine and software that produced them."""
    from tspbench.runtime.record import git_commit, hardware, utc_now, versions

    table = {str(p): measure(p, device_type, dtype) for p in ranks}
    return {
        "description": f"calibrated on {platform.node()} ({device_type}, {dtype})",
        "sources": ["tspbench calibrate (measured)"],
        "device": device_type,
        "dtype": dtype,
        "gpus_per_node": max(ranks),
        "hardware": hardware(torch.device(device_type), max(ranks)),
        "versions": versions("nccl" if device_type == "cuda" else "gloo"),
        "git_commit": git_commit(),
        "measured_utc": utc_now(),
        "ranks": table,
    }


def summary(preset: dict[str, Any]) -> str:
    """One line per measured rank count: the best GEMM and attention rates, copy bandwidth,
    per-op overhead and the all-reduce's latency and bandwidth."""
    return "\n".join(
        f"{p} rank(s): GEMM {max(r['gemm_flops_by_n'].values()) / 1e9:.1f} GFLOP/s (best "
        f"size), attention {max(r['attention_flops_by_d'].values()) / 1e9:.1f} GFLOP/s, "
        f"copy {r['memory_bandwidth'] / 1e9:.1f} GB/s, {r['op_overhead_s'] * 1e6:.1f} us/op, "
        "all-reduce "
        f"{r['all_reduce']['lat'] * 1e3:.2f} ms + {r['all_reduce']['bw'] / 1e9:.2f} GB/s"
        for p, r in preset["ranks"].items()
    )
