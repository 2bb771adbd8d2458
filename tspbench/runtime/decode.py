"""One measured decode run (``--mode decode`` or ``generate``) on one rank; rank 0 summarises.

A generation is the prompt's prefill (into the KV cache) then ``new_tokens - 1`` decode steps,
greedy (``docs/decode.md``). Order: one untimed *probe* generation under the memory tracker (its
peak, the cache's bytes, the generated tokens), one under the FLOP counter alone (never while
memory is measured, as in :mod:`tspbench.runtime.measure`), ``warmup`` untimed generations, then
``steps`` timed ones. Each timed generation starts after a barrier; the prefill is timed as one
piece, and each decode step on its own, back to back (as a server streams tokens); a time is the
slowest rank's. Bytes are counted per rank, apart for the prefill and the decode steps.

``decode`` reports the decode step as the record's step (``step_time_s`` the median latency per
token, ``tokens_per_s`` the batch's tokens per second); ``generate`` the whole generation.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

from tspbench.core.comm import blocked_in_collective
from tspbench.core.dtypes import DTYPES
from tspbench.core.memory import MemoryTracker
from tspbench.core.mesh import build_mesh
from tspbench.core.reference import make_batch
from tspbench.runtime.flops import counter
from tspbench.runtime.guard import process_age_s
from tspbench.runtime.measure import build_strategy, gc_held, gemm_rate
from tspbench.runtime.record_keys import DECODE_SUMMARY, ordered
from tspbench.runtime.spec import RunSpec
from tspbench.runtime.timing import timed


def generation(
    strat, tokens: torch.Tensor, n: int, device: torch.device, mesh=None, flops=None
) -> dict:
    """Prefill and ``n - 1`` decode steps, each timed; with ``mesh``, the bytes of each part;
    with ``flops`` (an active FLOP counter), the prefill's FLOPs. ``tokens`` of the result is
    the generated ids as a [B, n] tensor (fake on fake tensors)."""
    P, dec = tokens.shape[1], strat.decoding()
    if mesh is not None:
        mesh.counter.reset()
    (cache, step), t_prefill = timed(lambda: dec.prefill(tokens, P + n - 1), device)
    out: dict[str, Any] = {"prefill_s": t_prefill, "steps_s": [], "cache": cache}
    if flops is not None:
        out["prefill_flops"] = int(flops.get_total_flops())
    if mesh is not None:
        out["prefill_bytes"] = mesh.counter.by_kind()
        mesh.counter.reset()
    steps = [step]
    for _ in range(n - 1):
        step, dt = timed(lambda: dec.decode_step(cache, steps[-1].tokens), device)
        steps.append(step)
        out["steps_s"].append(dt)
    if mesh is not None:
        out["decode_bytes"] = mesh.counter.by_kind()
    out["tokens"] = torch.stack([s.tokens for s in steps], dim=1)
    return out


def measure_decode_rank(spec: RunSpec, device: torch.device, beat=lambda: None) -> dict[str, Any]:
    """Run the decode spec on this rank; return this rank's measurements (collective)."""
    mesh = build_mesh(spec.impl.mesh_dims(spec.layout))
    strat = build_strategy(spec, mesh, device)
    tokens, _ = make_batch(spec.cfg, spec.batch, spec.seq_len, spec.seed)
    n = spec.new_tokens
    rank0 = dist.get_rank() == 0
    beat()
    startup = process_age_s()  # joined, built: the first generation starts now

    tracker = MemoryTracker(limit=spec.max_memory)
    tracker.track(strat.parameters(), tokens)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad(), gc_held(), tracker:
        probe = generation(strat, tokens, n, device)
    out: dict[str, Any] = {
        "tracked_peak": tracker.peak,
        "kv_cache_bytes": probe["cache"].nbytes(),
        "generated_tokens": probe["tokens"].tolist(),
        "param_numel": strat.local_numel(),
        "startup_s": startup,
    }
    if device.type == "cuda":
        out["device_peak"] = torch.cuda.max_memory_allocated(device)
        out["device_reserved"] = torch.cuda.max_memory_reserved(device)
    del tracker, probe
    beat()
    with torch.no_grad(), gc_held(), counter() as flops:
        g = generation(strat, tokens, n, device, flops=flops)
    out["prefill_flops"] = g["prefill_flops"]
    out["decode_flops"] = (int(flops.get_total_flops()) - g["prefill_flops"]) / (n - 1)
    del g
    beat()

    for i in range(spec.warmup):
        with torch.no_grad():
            generation(strat, tokens, n, device)
        beat()
        if not spec.quiet and rank0:
            print(f"[tspbench] warmup generation {i + 1}/{spec.warmup}", flush=True)

    prefill_s, steps_s, calib = [], [], []
    prefill_b: dict[str, float] = {}
    decode_b: dict[str, float] = {}
    for i in range(spec.steps):
        calib.append(gemm_rate(device, DTYPES[spec.dtype]))
        with blocked_in_collective():
            dist.barrier()
        with torch.no_grad():
            g = generation(strat, tokens, n, device, mesh)
        beat()
        prefill_s.append(g["prefill_s"])
        steps_s.extend(g["steps_s"])
        for acc, got in ((prefill_b, g["prefill_bytes"]), (decode_b, g["decode_bytes"])):
            for kind, b in got.items():
                acc[kind] = acc.get(kind, 0.0) + b
        if not spec.quiet and rank0:
            ms = statistics.median(g["steps_s"]) * 1e3
            print(f"[tspbench] generation {i + 1}/{spec.steps}: prefill {g['prefill_s'] * 1e3:.1f}"
                  f" ms, decode {ms:.2f} ms/token (rank 0)", flush=True)  # fmt: skip
    times = torch.tensor(prefill_s + steps_s, dtype=torch.float64, device=device)
    with blocked_in_collective():  # a step lasts as long as its slowest rank
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
    k = spec.steps
    out["prefill_times"] = times[:k].tolist()
    out["decode_times"] = times[k:].tolist()
    out["calib_gflops"] = statistics.median(calib)
    out["prefill_bytes"] = {kind: b / k for kind, b in prefill_b.items()}
    out["decode_bytes"] = {kind: b / (k * (n - 1)) for kind, b in decode_b.items()}
    return out


def _quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile, linear between order statistics (numpy's default)."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def generation_bytes(prefill: dict, per_step: dict, n: int) -> dict[str, float]:
    """Bytes by kind of a whole generation: the prefill's and ``n - 1`` decode steps', in a
    fixed order (prefill's kinds, then the steps' new ones), so records do not depend on the
    hash seed."""
    kinds = dict.fromkeys([*prefill, *per_step])
    return {k: prefill.get(k, 0.0) + (n - 1) * per_step.get(k, 0.0) for k in kinds}


def summarize_decode(spec: RunSpec, ranks: list[dict[str, Any]], peak_flops: float | None) -> dict:
    """The measurement part of a decode record, from every rank's results (rank order): the
    keys of :data:`~tspbench.runtime.record_keys.DECODE_SUMMARY`, in its order."""
    r0, n, B = ranks[0], spec.new_tokens, spec.batch
    peaks = [r.get("device_peak", r["tracked_peak"]) for r in ranks]
    k = spec.steps
    prefill = r0["prefill_times"]
    decode = r0["decode_times"]
    gens = [prefill[i] + sum(decode[i * (n - 1) : (i + 1) * (n - 1)]) for i in range(k)]
    latency = statistics.median(decode)
    generate_s = statistics.median(gens)
    per_token = sum(r0["decode_bytes"].values())
    prefill_bytes = sum(r0["prefill_bytes"].values())
    if spec.mode == "decode":
        step_times, comm = decode, r0["decode_bytes"]
        flops = sum(r["decode_flops"] for r in ranks)
        flops_rank = [r["decode_flops"] for r in ranks]
        tokens_per_s = B / latency
    else:
        step_times = gens
        comm = generation_bytes(r0["prefill_bytes"], r0["decode_bytes"], n)
        flops_rank = [r["prefill_flops"] + (n - 1) * r["decode_flops"] for r in ranks]
        flops = sum(flops_rank)
        tokens_per_s = B * n / generate_s
    step_time = statistics.median(step_times)
    calib = statistics.median(r["calib_gflops"] for r in ranks)
    world = len(ranks)
    values = {
        "peak_mem_bytes": max(peaks),
        "peak_mem_bytes_per_rank": peaks,
        "peak_mem_bytes_first_step": max(peaks),
        "peak_mem_bytes_first_step_per_rank": peaks,
        "peak_mem_source": "cuda_max_memory_allocated" if "device_peak" in r0 else "tracked",
        "peak_parts_bytes": None,  # (training and forward steps only)
        "peak_reserved_bytes_per_rank": [r["device_reserved"] for r in ranks]
        if "device_reserved" in r0
        else None,
        "kv_cache_bytes": max(r["kv_cache_bytes"] for r in ranks),
        "kv_cache_bytes_per_rank": [r["kv_cache_bytes"] for r in ranks],
        "prefill_time_s": statistics.median(prefill),
        "prefill_times_s": prefill,
        "decode_latency_s": latency,
        "decode_latency_p90_s": _quantile(decode, 0.9),
        "decode_tokens_per_s": B / latency,
        "generate_time_s": generate_s,
        "generated_tokens": r0["generated_tokens"],
        "decode_bytes_per_token": per_token,
        "decode_bytes_per_token_by_kind": r0["decode_bytes"],
        "decode_bytes_per_token_per_rank": [sum(r["decode_bytes"].values()) for r in ranks],
        "prefill_comm_bytes": prefill_bytes,
        "step_time_s": step_time,
        "step_time_min_s": min(step_times),
        "step_time_max_s": max(step_times),
        "step_times_s": step_times,
        "tokens_per_s": tokens_per_s,
        "comm_bytes": comm,
        "comm_bytes_total": sum(comm.values()),
        "comm_bytes_model_group": sum(comm.values()),
        "comm_bytes_dp": 0.0,
        "comm_bytes_per_rank": [
            sum(r["decode_bytes"].values())
            if spec.mode == "decode"
            else sum(r["prefill_bytes"].values()) + (n - 1) * sum(r["decode_bytes"].values())
            for r in ranks
        ],
        "flops_counted": "model",  # generation recomputes nothing: executed is the same
        "flops_per_step": int(flops),
        "flops_executed_per_step": int(flops),
        "flops_per_rank": [int(f) for f in flops_rank],
        "mfu": flops / (step_time * world * peak_flops) if peak_flops else None,
        "param_numel_per_rank": [r["param_numel"] for r in ranks],
        "optimizer_numel_per_rank": [0 for _ in ranks],
        "loss": None,
        "grad_norm": None,
        "calib_gflops": calib,
        "startup_s": max(r["startup_s"] for r in ranks),
        "tokens_per_s_per_gflops": tokens_per_s / calib,
    }
    return ordered(DECODE_SUMMARY, values)
