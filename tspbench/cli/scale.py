"""Paper scale without the hardware: ``tspbench model | estimate | project | project-check |
calibrate``. Each takes the same run arguments as ``tspbench run`` (nothing is launched)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tspbench.cli.args import add_run_args
from tspbench.core.config import ConfigError
from tspbench.runtime.spec import RunSpec

GiB = 2**30


def _spec(args: argparse.Namespace) -> RunSpec:
    return RunSpec.from_args(args).replace(quiet=True)


def _emit(args: argparse.Namespace, obj: dict[str, Any], text: str) -> None:
    from tspbench.runtime.record import write_json

    print(json.dumps(obj, indent=1, default=str) if args.json else text)
    if getattr(args, "out", None):
        if not args.out.endswith(".json"):
            raise ConfigError(f"--out={args.out!r}: must name a .json file")
        write_json(args.out, obj)


def _provenance() -> dict[str, Any]:
    import torch

    from tspbench.runtime.record import git_commit, utc_now, versions

    return {
        "git_commit": git_commit(),
        "timestamp_utc": utc_now(),
        "versions": versions("gloo"),
        "host_cpu": torch.backends.cpu.get_cpu_capability(),
    }


def _analytic(c: RunSpec) -> tuple[dict, dict, dict]:
    """Memory, bytes by (phase, kind) and FLOPs of ``c`` in closed form; a decode run's
    memory is the decode model's, its bytes the prefill's plus one decode step's, its FLOPs
    the prefill's (docs/decode.md)."""
    from tspbench.projection import analytic, decode

    if not c.decoding:
        return analytic.memory(c), analytic.comm_bytes(c), analytic.flop_parts(c)
    pre = decode.prefill_spec(c)
    comm = {("prefill", k): b for (_, k), b in analytic.comm_bytes(pre).items()}
    comm.update({("decode step", k): b for k, b in decode.bytes_per_token(c).items()})
    return decode.memory(c), comm, analytic.flop_parts(pre)


def cmd_model(args: argparse.Namespace) -> int:
    from tspbench.projection import analytic

    c = _spec(args)
    mem, comm, fl = _analytic(c)
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
    lines.append(f"{what} per rank: GEMM {fl['gemm']:.4g}, attention {fl['attention']:.4g}")
    _emit(args, obj, "\n".join(lines))
    return 0


def _ranks(text: str, degree: int) -> list[int] | None:
    if text == "all":
        return None
    try:
        ranks = [int(x) for x in text.split(",")]
    except ValueError:
        ranks = [-1]
    if any(r < 0 or r >= degree for r in ranks):
        raise ConfigError(f"--ranks={text!r}: must be 'all' or ranks in 0..{degree - 1}")
    return ranks


def cmd_estimate(args: argparse.Namespace) -> int:
    from tspbench.projection.estimate import estimate

    spec = c = _spec(args)
    ranks = _ranks(args.ranks, spec.layout.degree)
    est = estimate(spec, ranks, args.kernel)
    ana = _analytic(c)[0]
    limit = args.device_memory * GiB
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
        "fits": est["peak_mem_bytes"] <= limit,
        **_provenance(),
    }
    text = (
        f"fake-tensor estimate: {spec.strategy} {spec.cfg.name} S={spec.seq_len} "
        f"D={spec.layout.degree} {spec.mode} {spec.dtype} recompute={spec.recompute}\n"
        f"  peak per GPU {est['peak_mem_bytes'] / GiB:.2f} GiB (first step "
        f"{est['peak_mem_bytes_first_step'] / GiB:.2f}; analytic {ana['peak'] / GiB:.2f}) "
        f"ranks {est['estimated_ranks']}: "
        + ", ".join(f"{p / GiB:.2f}" for p in est["peak_mem_bytes_per_rank"])
        + f"\n  {'fits' if obj['fits'] else 'does NOT fit'} in {args.device_memory:g} GiB; "
        f"{est['comm_bytes_total'] / GiB:.3f} GiB communicated per step and rank; "
        f"estimated in {est['estimate_s']:.1f} s"
    )
    if spec.decoding:
        text += (
            f"\n  KV cache {est['kv_cache_bytes'] / GiB:.3f} GiB per GPU; "
            f"{est['decode_bytes_per_token'] / 2**20:.4f} MiB per decode step and rank, "
            f"{est['prefill_comm_bytes'] / GiB:.3f} GiB in the prefill"
        )
    _emit(args, obj, text)
    return 0


def cmd_project(args: argparse.Namespace) -> int:
    from tspbench.projection.costmodel import default_mlp_schedule, load_preset, project
    from tspbench.projection.decode import project_decode

    spec = c = _spec(args)
    preset = load_preset(args.hardware)
    if args.mlp_schedule is None:  # TSP: the preset's schedule
        spec = c = default_mlp_schedule(c, preset)
    res = project_decode(c, preset) if c.decoding else project(c, preset)
    mlp = {"mlp_schedule": c.mlp_schedule} if len(c.impl.mlp_schedules) > 1 else {}
    obj = {"hardware": preset["name"], "projected": True, **mlp, **res}
    text = (
        f"projected on {preset['name']}: {spec.label} {spec.cfg.name} S={spec.seq_len} "
        f"D={spec.layout.degree} dp={spec.layout.dp} {spec.mode}\n"
        + "\n".join(
            f"  {k:20s} {v:.6g}" if isinstance(v, float) else f"  {k:20s} {v}"
            for k, v in res.items()
        )  # fmt: skip
    )
    _emit(args, obj, text)
    return 0


def cmd_project_check(args: argparse.Namespace) -> int:
    from tspbench.projection.costmodel import check_footer, check_summary, load_preset
    from tspbench.runtime.record import write_atomic

    for path in args.summary:
        if not Path(path).is_file():
            raise ConfigError(f"--summary={path}: no such file; give an aggregate summary.csv")
    preset = load_preset(args.hardware)
    table = check_summary(args.summary, preset)
    text = table.to_markdown(index=False, floatfmt=".3f") + "\n\n" + check_footer(table)
    print(text)
    if args.out:
        write_atomic(args.out, text)
    if args.csv:
        write_atomic(args.csv, table.to_csv(index=False))
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from tspbench.projection.calibrate import calibrate
    from tspbench.runtime.record import write_json

    try:
        ranks = sorted({int(x) for x in args.ranks.split(",")})
    except ValueError:
        ranks = [0]
    if not ranks or min(ranks) < 1 or max(ranks) > 64:
        raise ConfigError(f"--ranks={args.ranks!r}: must be comma-separated integers in 1..64")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device=cuda: no CUDA/ROCm device here (use --device cpu)")
    if not args.out.endswith(".json"):
        raise ConfigError(f"--out={args.out!r}: must name a .json file")
    preset = calibrate(ranks, args.device, args.dtype)
    write_json(args.out, preset)
    for p, r in preset["ranks"].items():
        print(
            f"{p} rank(s): GEMM {max(r['gemm_flops_by_n'].values()) / 1e9:.1f} GFLOP/s (best "
            f"size), attention {max(r['attention_flops_by_d'].values()) / 1e9:.1f} GFLOP/s, "
            f"copy {r['memory_bandwidth'] / 1e9:.1f} GB/s, {r['op_overhead_s'] * 1e6:.1f} us/op, "
            "all-reduce "
            f"{r['all_reduce']['lat'] * 1e3:.2f} ms + {r['all_reduce']['bw'] / 1e9:.2f} GB/s"
        )
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def cmd_projected_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tspbench.pipeline.projected import load, write_report

    cfg = load(args.config)
    command = f"snakemake project --cores 2 (config {args.config})"
    write_report(cfg, Path(args.estimates), Path(args.out), Path(args.plots), command)
    print(f"wrote {args.out} and {args.plots}")
    return 0


def add_parsers(sub) -> None:
    m = sub.add_parser("model", help="analytic memory, bytes and FLOPs per rank (closed forms)")
    add_run_args(m)
    m.add_argument("--json", action="store_true")
    m.add_argument("--out", default=None, help="also write the JSON here")
    m.set_defaults(func=cmd_model)

    e = sub.add_parser("estimate", help="fake-tensor run of one step at any world size")
    add_run_args(e)
    e.add_argument(
        "--ranks",
        default="0",
        help="ranks of the model group to estimate: 0 (default: zigzag gives rank 0 the longest "
        "keys, so the largest buffers), a list such as 0,3, or all",
    )
    e.add_argument(
        "--kernel",
        choices=("fused", "cpu_flash"),
        default="fused",
        help="attention memory as a fused GPU flash kernel (default) or the CPU kernel",
    )
    e.add_argument("--device-memory", type=float, default=192.0, help="GiB per GPU for 'fits'")
    e.add_argument("--json", action="store_true")
    e.add_argument("--out", default=None)
    e.set_defaults(func=cmd_estimate)

    p = sub.add_parser("project", help="projected step time and tokens/s on a hardware preset")
    add_run_args(p)
    p.add_argument("--hardware", default="mi300x", help="mi300x, h100, h200 or a calibrated .json")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None)
    p.set_defaults(func=cmd_project)

    pc = sub.add_parser(
        "project-check", help="project every cell of a measured summary and report the error"
    )
    pc.add_argument(
        "--summary",
        required=True,
        nargs="+",
        help="aggregate CSV of measured runs; several: repeated runs of one sweep (median, range)",
    )
    pc.add_argument("--hardware", required=True, help="the calibrated preset of that machine")
    pc.add_argument("--out", default=None, help="Markdown table")
    pc.add_argument("--csv", default=None)
    pc.set_defaults(func=cmd_project_check)

    pr = sub.add_parser("projected-report", help="projected paper-scale tables and figures")
    pr.add_argument("--config", default="workflows/config/projected.yaml")
    pr.add_argument("--estimates", required=True, help="folder of estimate JSONs")
    pr.add_argument("--out", required=True)
    pr.add_argument("--plots", required=True)
    pr.set_defaults(func=cmd_projected_report)

    c = sub.add_parser("calibrate", help="microbenchmark this machine into a hardware preset")
    c.add_argument("--ranks", default="1,2,4", help="rank counts to measure with")
    c.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    c.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    c.add_argument("--out", required=True, help="preset JSON to write")
    c.set_defaults(func=cmd_calibrate)
