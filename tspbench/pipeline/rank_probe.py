"""The doctor's rank probe: rank 0 of a D = 8 cell, for real, on one device.

One GPU cannot run a D = 8 job, but it can run one rank of it: torch's fake process group
(backend ``fake``: every collective completes at once and moves nothing) with real tensors, real
kernels and the real allocator. Values are meaningless (what a collective should have brought is
left as it was), shapes, kernels and allocations are not. So the peak one rank of every strategy
reaches is measured where it will run, before a sweep commits GPU-hours to it, and compared with
the fake-tensor estimate of the same cell (:mod:`tspbench.projection.estimate`), which the
projected tables and the planner trust, and with the analytic model (shown, not judged).

The steps are a measured run's (:func:`tspbench.runtime.measure.probe`: a first step, then the
steady-state step whose peak ``tspbench run`` records, then a FLOP-counted one): on a GPU the
peak is ``torch.cuda.max_memory_allocated`` (reset before the step), on a CPU the suite's
:class:`MemoryTracker`, as ``tspbench run`` records them. Three more steady steps are timed,
with the host's issue time beside (collectives are free here: compute and dispatch only, what
the cost model's compute and exposed-host terms predict). The cell depends on the device: on a
GPU two layers of 7B at S = 16K in bf16 (multi-GiB peaks, so fixed overheads stay under 2%), on
a CPU a small fp32 cell that runs in seconds.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import statistics
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from tspbench.core.config import ConfigError, ModelConfig, get_config
from tspbench.core.mesh import build_mesh
from tspbench.core.optim import AdamW
from tspbench.core.options import Value
from tspbench.core.reference import make_batch
from tspbench.core.strategy import Layout, Strategy
from tspbench.pipeline.check import PEAK_BOUND, Check, in_bound, run_check
from tspbench.projection import analytic
from tspbench.projection.estimate import estimate
from tspbench.runtime.measure import build_strategy, one_step, probe
from tspbench.runtime.record import write_json
from tspbench.runtime.registry import strategies
from tspbench.runtime.spec import RunSpec
from tspbench.runtime.timing import timed_issue

Plan = list[tuple[str, Callable[[], str | None], str | None]]

# (model, layers, sequence length, dtype) of the probed cell, by device type
CELLS = {"cuda": ("7b", 2, 16384, "bf16"), "cpu": ("small", 2, 1024, "fp32")}
TIMED = 3  # steady steps timed after the peak probe


def factor_pairs(degree: int) -> list[list[int]]:
    """T x Sigma factorisations of ``degree`` a factored strategy is probed at: the folded ones
    (both factors above 1, as the sweeps take them), or every one where there is none (D = 2)."""
    pairs = [[t, degree // t] for t in range(1, degree + 1) if degree % t == 0]
    folded = [p for p in pairs if min(p) > 1]
    return folded or pairs


def layouts(impl: type[Strategy], degree: int) -> list[Layout]:
    """The model groups of ``degree`` ranks a sweep gives ``impl`` (none: it does not take D)."""
    if impl.reference:
        return []
    return [
        lay for lay in impl.sweep_layouts([degree], factor_pairs(degree)) if lay.degree == degree
    ]


def cell_name(spec: RunSpec) -> str:
    """``tsp (broadcast MLP) D=8 (7b, 2 layers, S=16384, bf16)``: the strategy, its options
    where not the defaults, and the cell, as lines print it."""
    n = spec.cfg.layers
    what = f"{spec.cfg.name}, {n} layer{'s' * (n != 1)}, S={spec.seq_len}, {spec.dtype}"
    return f"{spec.label} D={spec.degree} ({what})"


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@contextlib.contextmanager
def fake_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """Torch's fake process group for the ``with`` body, destroyed after it (so a real group,
    the estimator's own fake one, or a second probe can follow in the same process)."""
    if dist.is_initialized():
        raise RuntimeError("the rank probe needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _peaks(spec: RunSpec, device: torch.device) -> dict[str, Any]:
    """A measured run's probe steps on this rank (its tensors are freed on return)."""
    mesh = build_mesh(spec.impl.mesh_dims(spec.layout))
    strat = build_strategy(spec, mesh, device)
    tokens, labels = make_batch(spec.cfg, spec.batch * spec.layout.dp, spec.seq_len, 0)
    batch = strat.shard_batch(tokens, labels)
    del tokens, labels
    opt = AdamW(strat.parameters()) if spec.mode == "train" else None
    found, _ = probe(lambda: one_step(strat, batch, opt), strat, batch, opt, device)
    return found | _times(lambda: one_step(strat, batch, opt), device)


def _times(step: Callable[[], Any], device: torch.device, n: int = TIMED) -> dict[str, float]:
    """Median seconds of ``n`` steady steps on this rank and of the host's issue of them.
    Collectives complete at once on the fake group, so this is the rank's compute and dispatch
    without communication: what a cost model's compute and exposed-host terms predict."""
    runs = [timed_issue(step, device)[1:] for _ in range(n)]
    return {
        "step_s": statistics.median(r[0] for r in runs),
        "issue_s": statistics.median(r[1] for r in runs),
    }


def measure_rank0(spec: RunSpec, device: torch.device) -> dict[str, Any]:
    """Rank 0 of ``spec`` on ``device`` under the fake group: the peak of a measured run's
    steady-state probe step (the allocator's on a GPU, else the tracker's)."""
    with fake_group(spec.layout.world_size):
        found = _peaks(spec, device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    peak = found.get("device_peak", found["tracked_peak"])
    times = {k: found[k] for k in ("step_s", "issue_s")}
    return {"measured_bytes": peak, "tracked_bytes": found["tracked_peak"], **times}


def probe_spec(spec: RunSpec, device: torch.device) -> dict[str, Any]:
    """Measured, estimated and analytic peaks of ``spec``'s rank 0, and their ratios."""
    # the estimator shapes the kernel this device runs: flash-attn's calls on a GPU (``fused``)
    kernel = "cpu_flash" if device.type == "cpu" else "fused"
    out: dict[str, Any] = {
        "strategy": spec.strategy,
        "tag": spec.tag,
        "degree": spec.degree,
        "model": spec.cfg.name,
        "layers": spec.cfg.layers,
        "seq_len": spec.seq_len,
        "batch": spec.batch,
        "dtype": spec.dtype,
        "device": device.type,
        "kernel": kernel,
        **measure_rank0(spec, device),
    }
    # the measured rank ran on the fake group too, which stages no buffer: nor does its estimate
    out["estimate_bytes"] = estimate(spec, [0], kernel, backend="fake")["peak_mem_bytes"]
    out["analytic_bytes"] = analytic.memory(spec)["peak"]
    out["ratio"] = out["measured_bytes"] / out["estimate_bytes"]
    out["analytic_ratio"] = out["measured_bytes"] / out["analytic_bytes"]
    return out


def probe_specs(
    device: torch.device, degree: int = 8, cell: tuple[str, int, int, str] | None = None,
    names: list[str] | None = None,
) -> list[tuple[str, RunSpec | None, str | None]]:  # fmt: skip
    """(check name, spec, why skipped) for every registered strategy (or ``names``) at
    ``degree``, on the device's cell (``cell``: model, layers, S, dtype instead)."""
    model, n_layers, seq_len, dtype = cell or CELLS["cuda" if device.type == "cuda" else "cpu"]
    cfg = get_config(model, layers=n_layers)
    out: list[tuple[str, RunSpec | None, str | None]] = []
    for name, impl in strategies().items():
        if names is not None and name not in names:
            continue
        lays = layouts(impl, degree)
        if not lays:
            why = "the single-device reference" if impl.reference else "takes no model group"
            out.append(
                (f"rank probe {name} D={degree}", None, f"{why}: D = {degree} makes no sense")
            )
        for lay in lays:
            for options in variants(impl, cfg):
                try:
                    spec = RunSpec(
                        strategy=name, cfg=cfg, layout=lay, seq_len=seq_len,
                        batch=impl.replica_batch(lay), dtype=dtype, options=options,
                    )  # fmt: skip
                except ConfigError as e:  # not a cell this strategy runs: say so, once
                    what = f"{impl.label(lay)} {options or ''}".strip()
                    out.append((f"rank probe {what} D={degree} ({model})", None, str(e)))
                    if not options:
                        break  # the defaults refused: so will each variant, for the same cell
                    continue
                out.append((f"rank probe {cell_name(spec)}", spec, None))
    return out


def variants(impl: type[Strategy], cfg: ModelConfig) -> list[dict[str, Value]]:
    """The strategy at its defaults, then at each other value of each of its choice options
    that can change a run of ``cfg`` (TSP's MLP schedule, SP's K/V exchange, ...; TSP's expert
    schedule with experts only), one at a time: a sweep may run any of them, and each
    allocates and computes differently."""
    return [{}] + [
        {o.name: v}
        for o in impl.options
        if o.choices and o.applies(1, cfg.moe)
        for v in o.choices
        if v != o.default
    ]


def probe_plan(
    device: torch.device, found: dict[str, dict], degree: int = 8,
    cell: tuple[str, int, int, str] | None = None, names: list[str] | None = None,
) -> Plan:  # fmt: skip
    """The probe as doctor plan items (name, check function, skip); each function leaves its
    measurements in ``found`` under its check name."""

    def check(name: str, spec: RunSpec | None) -> str:
        assert spec is not None  # a probe without a spec is skipped, never run
        r = found[name] = probe_spec(spec, device)
        line = f"measured {_size(r['measured_bytes'])}, estimate {_size(r['estimate_bytes'])} "
        line += f"({r['ratio']:.2f}x); analytic {_size(r['analytic_bytes'])} "
        line += f"({r['analytic_ratio']:.2f}x, not judged); step {r['step_s']:.3g} s without "
        line += f"communication (host issue {r['issue_s']:.3g} s)"
        assert in_bound(r["ratio"]), f"{line}: measured/estimate outside {list(PEAK_BOUND)}"
        return line

    return [
        (name, functools.partial(check, name, spec), skip)
        for name, spec, skip in probe_specs(device, degree, cell, names)
    ]


def results(checks: list[Check], found: dict[str, dict]) -> list[dict[str, Any]]:
    """One dict per probe check: its line's fields and, where it ran, its measurements."""
    return [{**asdict(c), **found.get(c.name, {})} for c in checks]


def rank_probe(
    device: torch.device | None = None, degree: int = 8,
    cell: tuple[str, int, int, str] | None = None, names: list[str] | None = None,
    out: Path | None = None, echo: bool = True,
) -> tuple[list[Check], list[dict[str, Any]]]:  # fmt: skip
    """Probe rank 0 of every registered strategy at ``degree`` on ``device`` (default: GPU 0,
    else the CPU); print each line (``echo``); write the results to ``out`` (JSON) if given."""
    if device is None:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    found: dict[str, dict] = {}
    checks = []
    for name, fn, skip in probe_plan(device, found, degree, cell, names):
        checks.append(run_check(name, fn, skip))
        if echo:
            print(checks[-1].line(), flush=True)
    res = results(checks, found)
    if out is not None:
        write_json(out, {"bound": list(PEAK_BOUND), "rank_probe": res})
    return checks, res
