"""Rank-side checks: run a strategy and the single-device reference on the same data, compare.

Runs inside a spawned gloo world (see distributed.py). A case runs on model groups of size D
laid side by side ("replica" axis, no gradient exchange between them); every rank builds the
reference itself, so rank 0 can compare alone.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from tspbench.core.config import get_config
from tspbench.core.dtypes import DTYPES
from tspbench.core.memory import MemoryTracker
from tspbench.core.mesh import build_mesh
from tspbench.core.optim import AdamW
from tspbench.core.reference import ReferenceModel, make_batch
from tspbench.runtime import registry
from tspbench.runtime.spec import RunSpec


@functools.cache
def mesh_for(dims: tuple[tuple[str, int], ...]):
    return build_mesh(dict(dims))


# a case's run fields and their RunSpec names (the rest of a case: its id, model overrides,
# tolerances and test-only knobs)
RUN_FIELDS = {"D": "degree", "S": "seq_len", "P": "seq_len", "B": "batch", "N": "new_tokens"} | {
    k: k for k in ("tp", "sp", "dp", "dtype", "seed", "mode", "recompute")
}


def run_fields() -> dict[str, str]:
    """RUN_FIELDS and every registered strategy's options (flat in a case, as in a record)."""
    return RUN_FIELDS | {k: k for k in registry.all_options()}


def case_spec(case: dict, **fixed) -> RunSpec:
    """The RunSpec of a test case: its run fields go straight into RunSpec.make under RunSpec's
    names, on the tiny model with the case's overrides; ``fixed`` adds fields the test sets."""
    names = run_fields()
    fields = {names[k]: v for k, v in case.items() if k in names}
    cfg = get_config("tiny", **case.get("model", {}))
    return RunSpec.make(case["strategy"], cfg, **fields, **fixed)


def argv_spec(argv: list[str]) -> RunSpec:
    """The RunSpec ``tspbench run ARGV`` would run, parsed in-process."""
    from tspbench.cli import make_parser

    return RunSpec.from_args(make_parser().parse_args(["run", *argv, "--out", "x.json"]))


def make_strategy(case: dict):
    """Build the case's strategy on a mesh of side-by-side model groups (collective)."""
    spec = case_spec(case)
    world = dist.get_world_size()
    dims = (("replica", world // spec.layout.world_size), *spec.impl.mesh_dims(spec.layout).items())
    mesh = mesh_for(tuple(dims))
    mesh.counter.reset()
    opts = {"dp_bucket_mb": case["dp_bucket_mb"]} if "dp_bucket_mb" in case else {}
    strat = spec.impl(
        spec.cfg, mesh, seed=spec.seed, dtype=DTYPES[spec.dtype], recompute=spec.recompute,
        **spec.options, **opts,
    )  # fmt: skip
    return strat, spec.cfg


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference relative to the reference tensor's max magnitude."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


LR = 1e-3  # AdamW's default in tspbench.core.optim


def close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float | None = None) -> bool:
    """Element-wise rtol, with atol scaled to the tensor (rtol alone is void near zero)."""
    a, b = a.detach().double(), b.detach().double()
    atol = rtol * 0.1 * float(b.abs().max()) if atol is None else atol
    return bool(torch.allclose(a, b, rtol=rtol, atol=atol))


# bf16 runs are compared with the fp32 reference by max error relative to each tensor's max.
# Measured: the bf16 single-device model itself is off by about 1e-5 (loss), 7e-3 (hidden),
# 2e-2 (grads) and 5e-2 (weights after 3 steps: bf16 rounding of the fp32 master, plus AdamW's
# sign-like update of near-zero grads); every strategy lands at the same levels.
BF16_TOL = {"loss": 1e-3, "grad_norm": 2e-2, "hidden": 2e-2, "grad": 5e-2, "step3": 0.1}


def check_equal(case: dict) -> dict:
    """Loss, hidden states, every gradient, and weights after 3 AdamW steps vs the reference.

    Rank 0 compares alone (every caller reads rank 0's result): it alone builds and steps the
    reference; every rank makes the strategy's calls, in the same order (any may be a
    collective). The other ranks return no verdict (``ok`` None: a caller reading them fails),
    and step no reference of their own, which nobody read (on 2 cores, a 4-rank world's
    references took about as long as its strategies)."""
    strat, cfg = make_strategy(case)
    compare = dist.get_rank() == 0
    bf16 = case.get("dtype") == "bf16"
    rtol = case.get("rtol", 1e-4)
    # the reference sees the global batch: every replica's micro-batch
    tokens, labels = make_batch(cfg, case["B"] * case.get("dp", 1), case["S"], case.get("seed", 0))
    if compare:
        ref = ReferenceModel(cfg, seed=case.get("seed", 0), dtype=torch.float32)
        ref_opt = AdamW(list(ref.parameters()))
    strat_opt = AdamW(strat.parameters())
    res: dict = {"errors": {}, "ok": True} if compare else {"ok": None, "compared_on": 0}

    def record(name: str, a: torch.Tensor, b: torch.Tensor, tol: float, atol=None) -> None:
        res["errors"][name] = err(a, b)
        if bf16:
            ok = res["errors"][name] <= BF16_TOL[name.split(":")[0]]
        else:
            ok = close(a, b, tol, atol)
        if not ok:
            res["ok"] = False
            res.setdefault("failed", []).append(name)

    batch = strat.shard_batch(tokens, labels)
    hidden = strat.hidden(batch)
    if compare:
        record("hidden", hidden, strat.dp_slice(ref.loss(tokens, labels)[1]), rtol)
    for step in range(3):
        if compare:
            ref_loss, _ = ref.loss(tokens, labels)
            ref_loss.backward()
        loss = strat.forward_backward(batch)
        if step == 0:
            norm = strat.grad_sq_norm().sqrt()
            grads = strat.full_params(grads=True)
            if compare:
                record("loss", loss, ref_loss, rtol)
                ref_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in ref.parameters()))
                record("grad_norm", norm, ref_norm, rtol)
                ref_grads = {n: p.grad for n, p in ref.named_full_params().items()}
                for n, g in grads.items():
                    record(f"grad:{n}", g, ref_grads[n], rtol * case.get("grad_factor", 1))
        if compare:
            ref_opt.step()
            ref_opt.zero_grad()
        strat_opt.step()
        strat_opt.zero_grad()
    # AdamW normalises each gradient element by its own magnitude: an element whose gradient is
    # near eps (1e-8) turns fp32 noise into a visible fraction of one update. So after the steps
    # the absolute tolerance is a fraction of one update (lr per element), not of the weights:
    # 10% of one update (measured worst: 6%, at D=8 GQA, where every gradient matched to 1e-6).
    weights = strat.full_params()
    numel, opt_numel = strat.local_numel(), strat_opt.state_numel()
    if not compare:
        return res
    ref_full = ref.named_full_params()
    for n, w in weights.items():
        record(f"step3:{n}", w, ref_full[n], rtol, atol=0.1 * LR)
    res["numel"] = numel
    res["opt_numel"] = opt_numel
    res["ref_numel"] = sum(p.numel() for p in ref.parameters())
    return res


def peak_bytes(case: dict) -> int:
    """Peak live tensor bytes of one training step (parameters, grads and activations)."""
    strat, cfg = make_strategy(case)
    tokens, labels = make_batch(cfg, case["B"], case["S"], seed=0)
    tracker = MemoryTracker()
    tracker.track(strat.parameters())
    batch = strat.shard_batch(tokens, labels)
    with tracker:
        strat.forward_backward(batch)
    return tracker.peak


def run_cases(cases: list[dict]) -> dict:
    """Run every case on every rank; return {case id: result} (rank 0's results are used)."""
    out = {}
    for case in cases:
        kind = case.get("check", "equal")
        try:
            run = {"equal": check_equal, "measure": measure_case, "allocator": allocator_case}.get(
                kind
            )
            out[case["id"]] = run(case) if run else {"peak": peak_bytes(case)}
        except Exception as e:  # reported per case so one failure does not hide the rest
            out[case["id"]] = {"ok": False, "exception": f"{type(e).__name__}: {e}"}
            raise
    return out


def measure_case(case: dict) -> dict:
    """The probe steps of ``tspbench run``: tracked peaks of the first and the steady-state step
    (parameters, fp32 masters, inputs, AdamW's state and everything the step allocates), FLOPs
    and bytes per kind of one step."""
    import torch

    from tspbench.runtime.measure import one_step, probe

    strat, cfg = make_strategy(case)
    tokens, labels = make_batch(cfg, case["B"], case["S"], seed=0)
    batch = strat.shard_batch(tokens, labels)
    train = case.get("mode", "train") == "train"
    opt = AdamW(strat.parameters()) if train else None
    step = lambda: one_step(strat, batch, opt)  # noqa: E731
    found, _ = probe(step, strat, batch, opt, torch.device("cpu"))
    by_kind = strat.mesh.counter.by_kind(axes=("model", "tp", "sp", "dp"))
    return {
        "peak": found["tracked_peak_first"],
        "peak_steady": found["tracked_peak"],
        "flops": found["flops"],
        "flops_executed": found["flops_executed"],
        "bytes": by_kind,
    }


def allocator_peak(prof) -> int:
    """High-water mark of the bytes torch's allocator handed out while ``prof`` (a profiler
    with ``profile_memory``) ran, on every thread of the process (a collective backend's worker
    thread included), from its allocation and free events in time order."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def allocator_case(case: dict) -> dict:
    """A steady-state training step (AdamW's state made by a first) seen twice at once: by the
    memory tracker (what the step adds to what is at rest, as the record's peak counts it) and
    by the profiler's allocator events (the allocator's own high-water mark over the step), and
    the largest backend staging buffer the step counted (``staged``: the one that can outlive
    its wait in the allocator's events)."""
    from torch.profiler import ProfilerActivity, profile

    from tspbench.core import memory
    from tspbench.runtime.measure import at_rest, gc_held, one_step

    strat, cfg = make_strategy(case)
    tokens, labels = make_batch(cfg, case["B"], case["S"], seed=0)
    batch = strat.shard_batch(tokens, labels)
    opt = AdamW(strat.parameters())
    one_step(strat, batch, opt)
    tracker = MemoryTracker()
    tracker.track(*at_rest(strat, batch, opt))
    rest = tracker.live
    staged, charge = [0], memory.charge

    def charge_seen(nbytes: int):
        staged[0] = max(staged[0], nbytes)
        return charge(nbytes)

    memory.charge = charge_seen  # (tspbench.core.comm charges through the module)
    try:
        with gc_held(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with tracker:
                one_step(strat, batch, opt)
    finally:
        memory.charge = charge
    return {
        "tracked": tracker.peak - rest,
        "allocator": allocator_peak(prof),
        "at_rest": rest,
        "staged": staged[0],
    }
