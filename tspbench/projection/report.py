"""The records and text of ``tspbench model | estimate | project | project-check``: one run's
closed forms, fake-tensor estimate or projection as a JSON-ready dict and as the lines a person
reads, so the command line only parses arguments and prints what it gets back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tspbench.runtime.spec import RunSpec

if TYPE_CHECKING:  # pandas only for project-check: model and estimate run without it
    import pandas as pd

GiB = 2**30


def closed_forms(c: RunSpec) -> tuple[Mapping[str, Any], dict, dict]:
    """Memory, bytes by (phase, kind) and FLOPs of ``c`` in closed form; a decode run's
    memory is the decode model's, its bytes the prefill's plus one decode step's, its FLOPs
    the prefill's (docs/decode.md)."""
    from tspbench.projection import analytic, decode

    if not c.decoding:
        return analytic.memory(c), analytic.comm_bytes(c), analytic.flop_parts(c)
    pre = decode.prefill_spec(c)
    comm = {("prefill", k): b for k, b in decode.prefill_bytes(c).items()}
    comm.update({("decode step", k): b for k, b in decode.bytes_per_token(c).items()})
    return decode.memory(c), comm, analytic.flop_parts(pre, loss=False)


def model_report(c: RunSpec) -> tuple[dict[str, Any], str]:
    """``tspbench model``: the closed forms of ``c`` (record, text)."""
    from tspbench.projection import analytic

    mem, comm, fl = closed_forms(c)
    obj = {
        "case": c.header("none", c.layout.world_size),
        "memory_bytes": mem,
        "comm_bytes": {f"{p}/{k}": b for (p, k), b in sorted(comm.items())},
        "comm_bytes_total": sum(comm.values()),
        "flops_per_rank": fl,
        "param_numel": analytic.param_numel(c),
    }
    lines = [f"analytic model: {c.strategy} {c.cfg.name} S={c.seq_len} D={c.degree} {c.mode}"]
    lines.append("memory per rank (GiB):")
    for k, v in mem.items():
        lines.append(f"  {k:18s} {v if isinstance(v, str) else f'{v / GiB:10.3f}'}")
    lines.append("bytes per step and rank (MiB), by phase/kind:")
    for (p, k), b in sorted(comm.items()):
        lines.append(f"  {p + '/' + k:28s} {b / 2**20:12.3f}")
    what = "prefill FLOPs" if c.decoding else "FLOPs"
    lines.append(  # executed: with what recomputation adds (records' flops_per_step do not)
        f"{what} per rank (executed): GEMM {fl['gemm']:.4g}, attention {fl['attention']:.4g}"
    )
    return obj, "\n".join(lines)


def provenance() -> dict[str, Any]:
    """What an estimate record says about where it was made (commit, time, versions, CPU)."""
    import torch

    from tspbench.runtime.record import git_commit, utc_now, versions

    return {
        "git_commit": git_commit(),
        "timestamp_utc": utc_now(),
        "versions": versions("gloo"),
        "host_cpu": torch.backends.cpu.get_cpu_capability(),
    }


def estimate_report(
    spec: RunSpec,
    ranks: list[int] | None,
    kernel: str,
    device_memory_gib: float,
    origin: str = "given",
) -> tuple[dict[str, Any], str]:
    """``tspbench estimate``: the fake-tensor estimate of ``spec`` on ``ranks`` (None: all),
    with the analytic peak beside it and whether it fits ``device_memory_gib`` (``origin``:
    where that cap comes from, printed beside it) (record, text)."""
    from tspbench.projection.estimate import estimate

    est = estimate(spec, ranks, kernel)
    ana = closed_forms(spec)[0]
    limit = device_memory_gib * GiB
    obj = {
        "strategy": spec.strategy,
        "model": spec.cfg.name,
        "seq_len": spec.seq_len,
        "degree": spec.layout.degree,
        "tp": spec.layout.tp,
        "sp": spec.layout.sp,
        "dp": spec.layout.dp,
        "batch": spec.batch,
        "mode": spec.mode,
        "dtype": spec.dtype,
        "recompute": spec.recompute,
        **est,
        "analytic_peak_bytes": ana["peak"],
        "device_memory_bytes": limit,
        "device_memory_origin": origin,
        "fits": est["peak_mem_bytes"] <= limit,
        **provenance(),
    }
    text = (
        f"fake-tensor estimate: {spec.strategy} {spec.cfg.name} S={spec.seq_len} "
        f"D={spec.layout.degree} {spec.mode} {spec.dtype} recompute={spec.recompute}\n"
        f"  peak per GPU {est['peak_mem_bytes'] / GiB:.2f} GiB (first step "
        f"{est['peak_mem_bytes_first_step'] / GiB:.2f}; analytic {ana['peak'] / GiB:.2f}) "
        f"ranks {est['estimated_ranks']}: "
        + ", ".join(f"{p / GiB:.2f}" for p in est["peak_mem_bytes_per_rank"])
        + f"\n  {'fits' if obj['fits'] else 'does NOT fit'} in {device_memory_gib:.1f} GiB "
        f"({origin}); {est['comm_bytes_total'] / GiB:.3f} GiB communicated per step and rank; "
        f"estimated in {est['estimate_s']:.1f} s"
    )
    if spec.decoding:
        text += (
            f"\n  KV cache {est['kv_cache_bytes'] / GiB:.3f} GiB per GPU; "
            f"{est['decode_bytes_per_token'] / 2**20:.4f} MiB per decode step and rank, "
            f"{est['prefill_comm_bytes'] / GiB:.3f} GiB in the prefill"
        )
    return obj, text


def project_report(spec: RunSpec, preset: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """``tspbench project``: the cost model's step time and throughput of ``spec`` on
    ``preset`` (record, text); the options a preset chooses (TSP's MLP schedule) are named."""
    from tspbench.projection.costmodel import counted_ops, project, project_range
    from tspbench.projection.decode import project_decode

    res = project_decode(spec, preset) if spec.decoding else project(spec, preset)
    if not spec.decoding:  # the range the rates' stated uncertainty gives (hardware.json)
        lo, hi = project_range(spec, preset, ops=counted_ops(res))
        res |= {"step_time_low_s": lo, "step_time_high_s": hi}
    chosen = {k: spec.options[k] for k in spec.impl.preset_options(preset)}
    obj = {"hardware": preset["name"], "projected": True, **chosen, **res}
    text = (
        f"projected on {preset['name']}: {spec.label} {spec.cfg.name} S={spec.seq_len} "
        f"D={spec.layout.degree} dp={spec.layout.dp} {spec.mode}\n"
        + "\n".join(
            f"  {k:20s} {v:.6g}" if isinstance(v, float) else f"  {k:20s} {v}"
            for k, v in res.items()
        )  # fmt: skip
    )
    return obj, text


def check_report(table: pd.DataFrame) -> str:
    """``tspbench project-check``: the per-cell table as Markdown with its summary footer."""
    from tspbench.projection.costcheck import check_footer

    shown = table
    if len(table) and table["runs"].max() == 1:  # single runs: no range to show
        shown = table.drop(columns=["measured_min_s", "measured_max_s", "spread", "inside_range"])
    return shown.to_markdown(index=False, floatfmt=".3f") + "\n\n" + check_footer(table)
