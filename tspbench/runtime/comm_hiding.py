"""How much of a strategy's communication hides behind its compute (``tspbench overlap``): any
strategy whose model group's schedule overlaps a collective when ``--overlap`` is on (TSP's
prefetched broadcasts and ring hops, FSDP+CP's prefetched all-gathers and drained
reduce-scatters).

Per step, measured in one run on the same shapes: the overlapped step (prefetch on), the same step
with overlap off, compute alone (collectives skipped: correctly shaped results, no transfer), and
communication alone (the step's traced collectives replayed back to back). Then
    hidden fraction = (t_compute + t_comm - t_step) / min(t_compute, t_comm)
1 means the shorter of the two is fully hidden, 0 means none of it is, negative means the
overlapped step is slower than doing both one after the other (contention: on a 2-core CPU the
collectives' threads and the GEMMs compete for the same cores).
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from tspbench.core.comm import blocked_in_collective
from tspbench.core.mesh import build_mesh
from tspbench.core.optim import AdamW
from tspbench.core.reference import make_batch
from tspbench.runtime.measure import build_strategy
from tspbench.runtime.registry import get_strategy
from tspbench.runtime.spec import RunSpec
from tspbench.runtime.timing import slowest, timed


def _timed(fn, steps: int, device: torch.device) -> float:
    """Median over steps of the slowest rank's time of ``fn``."""
    times = []
    for _ in range(steps):
        with blocked_in_collective():
            dist.barrier()
        times.append(timed(fn, device)[1])
    with blocked_in_collective():
        return statistics.median(slowest(times, device))


def bench_rank(spec: RunSpec, device: torch.device) -> dict:
    mesh = build_mesh(get_strategy(spec.strategy).mesh_dims(spec.layout))
    tokens, labels = make_batch(spec.cfg, spec.batch * spec.layout.dp, spec.seq_len, spec.seed)

    def make(overlap: bool):
        s = build_strategy(spec, mesh, device, overlap)
        opt = AdamW(s.parameters()) if spec.mode == "train" else None
        b = s.shard_batch(tokens, labels)

        def step():
            if opt is None:
                return s.forward_only(b)
            s.forward_backward(b)
            opt.step()
            opt.zero_grad()

        return step

    on, off = make(True), make(False)
    comms = list(mesh.comms.values())
    for _ in range(max(1, spec.warmup)):
        on()
        off()
    trace: list = []
    for c in comms:
        c.trace = trace
    on()
    for c in comms:
        c.trace = None

    def compute_only():
        for c in comms:
            c.skip = True
        try:
            on()
        finally:
            for c in comms:
                c.skip = False

    def comm_only():
        for axis, method, shape, dtype, kw in trace:
            mesh[axis].replay(method, shape, dtype, kw)

    t = {
        "step_overlap_s": _timed(on, spec.steps, device),
        "step_no_overlap_s": _timed(off, spec.steps, device),
        "compute_s": _timed(compute_only, spec.steps, device),
        "comm_s": _timed(comm_only, spec.steps, device),
    }
    shorter = min(t["compute_s"], t["comm_s"])
    t["hidden_fraction"] = (t["compute_s"] + t["comm_s"] - t["step_overlap_s"]) / shorter
    t["hidden_fraction_no_overlap"] = (
        t["compute_s"] + t["comm_s"] - t["step_no_overlap_s"]
    ) / shorter
    t["collectives_per_step"] = len(trace)
    return t


def check_hides(spec: RunSpec) -> None:
    """Refuse a run with nothing to measure: no collective of its step is ever overlapped, so
    overlap on and off are the same step."""
    from tspbench.core.config import ConfigError

    # no switch: nothing to turn off (DP's gradient buckets overlap with the switch on or off)
    on = spec.replace(overlap=True) if "overlap" in spec.options else None
    if on is None or not any(ev.overlapped for ev in on.impl.costs.schedule(on)):
        raise ConfigError(
            f"--strategy={spec.strategy}: overlaps none of its collectives in this layout "
            "(overlap on and off are the same step): nothing for the overlap benchmark to measure"
        )


def bench_work(spec: RunSpec, device: torch.device, header: dict, beat) -> dict:
    """``tspbench overlap`` on one rank of the job: the timings, printed by rank 0."""
    t = bench_rank(spec, device)
    if not spec.quiet and dist.get_rank() == 0:
        shown = (f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in t.items())
        print("[tspbench] " + ", ".join(shown), flush=True)
    return t
