"""Paper scale without the hardware: ``tspbench model | estimate | project | project-check |
calibrate``. Each takes the same run arguments as ``tspbench run`` (nothing is launched)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tspbench.cli.args import add_run_args, gib, out_dir, out_file, progress
from tspbench.core.config import ConfigError
from tspbench.core.dtypes import DTYPES
from tspbench.runtime.spec import RunSpec


def _spec(args: argparse.Namespace) -> RunSpec:
    return RunSpec.from_args(args).replace(quiet=True)


def _emit(args: argparse.Namespace, obj: dict[str, Any], text: str) -> None:
    from tspbench.runtime.record import write_json

    print(json.dumps(obj, indent=1, default=str) if args.json else text)
    if getattr(args, "out", None):  # probed when the arguments were read (args.out_file)
        write_json(args.out, obj)


def cmd_model(args: argparse.Namespace) -> int:
    from tspbench.projection.report import model_report

    _emit(args, *model_report(_spec(args)))
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
    from tspbench.projection.costmodel import load_preset, usable_memory
    from tspbench.projection.report import estimate_report

    spec = _spec(args)
    ranks = _ranks(args.ranks, spec.layout.degree)
    preset = load_preset(args.hardware)  # before the estimate: a bad name costs nothing
    if args.device_memory is not None:
        cap, origin = args.device_memory, "--device-memory"
    else:
        cap, origin = usable_memory(preset) / 2**30, f"usable on {preset['name']}"
    who = "every rank" if ranks is None else f"rank{'s' * (len(ranks) > 1)} {args.ranks}"
    progress("estimate", f"one step of {spec.label} {spec.cfg.name} S = {spec.seq_len} D = "
             f"{spec.layout.degree} on fake tensors, {who} (minutes at paper scale)")  # fmt: skip
    _emit(args, *estimate_report(spec, ranks, args.kernel, cap, origin))
    return 0


def cmd_project(args: argparse.Namespace) -> int:
    from tspbench.projection.costmodel import load_preset
    from tspbench.projection.report import project_report
    from tspbench.runtime.registry import all_options

    spec = _spec(args)
    preset = load_preset(args.hardware)
    named = [k for k in all_options() if getattr(args, k, None) is not None]
    spec = spec.preset_options(preset, named)  # TSP: the topology's MLP schedule
    progress("project", f"counting the operations of {spec.label} under fake tensors (one and "
             f"two layers), then costing them on {preset['name']}")  # fmt: skip
    _emit(args, *project_report(spec, preset))
    return 0


def cmd_project_check(args: argparse.Namespace) -> int:
    from tspbench.projection.costcheck import check_records, check_summary
    from tspbench.projection.costmodel import load_preset
    from tspbench.projection.report import check_report
    from tspbench.runtime.record import write_atomic

    if args.published is not None:
        return _published_check(args)
    what = "--records" if args.records else "--summary"
    if args.hardware is None:
        raise ConfigError(f"--hardware: required with {what} (the machine's preset)")
    for path in args.records or args.summary:
        if not Path(path).is_file():
            why = "not a file" if Path(path).exists() else "no such file"
            raise ConfigError(f"{what}={path}: {why}")
    preset = load_preset(args.hardware)
    if args.records:
        table = check_records(args.records, preset)
        if table.empty:
            raise ConfigError("--records: no ok training or forward record among them")
    else:
        table = check_summary(args.summary, preset)
    text = check_report(table)
    print(text)
    if args.out:
        write_atomic(args.out, text)
    if args.csv:
        write_atomic(args.csv, table.to_csv(index=False))
    return 0


def _published_check(args: argparse.Namespace) -> int:
    """``project-check --published [FILE]``: every point checked first, then projected."""
    from tspbench.projection import published
    from tspbench.runtime.record import write_atomic

    if args.hardware is not None or args.csv is not None:
        raise ConfigError("--published: takes each point's own preset; no --hardware or --csv")
    points = published.load(args.published or None)
    text = published.report(published.rows(points))
    print(text)
    if args.out:
        write_atomic(args.out, text)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from tspbench.projection.calibrate import calibrate, summary
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
    print(summary(preset))
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
    m.add_argument("--out", type=out_file(".json"), default=None, help="also write the JSON here")
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
    e.add_argument(
        "--hardware", default="mi300x", help="preset whose usable memory 'fits' is judged against"
    )
    e.add_argument(
        "--device-memory",
        type=gib,
        default=None,
        help="GiB per GPU for 'fits' instead of the preset's usable memory",
    )
    e.add_argument("--json", action="store_true")
    e.add_argument("--out", type=out_file(".json"), default=None)
    e.set_defaults(func=cmd_estimate)

    p = sub.add_parser("project", help="projected step time and tokens/s on a hardware preset")
    add_run_args(p)
    p.add_argument("--hardware", default="mi300x", help="mi300x, h100, h200 or a calibrated .json")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=out_file(".json"), default=None)
    p.set_defaults(func=cmd_project)

    pc = sub.add_parser(
        "project-check", help="project every cell of a measured summary and report the error"
    )
    what = pc.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--summary",
        nargs="+",
        help="aggregate CSV of measured runs; several: repeated runs of one sweep (median, range)",
    )
    what.add_argument(
        "--records",
        nargs="+",
        help="run records (.json) of measured runs, each projected with its own model and layout",
    )
    what.add_argument(
        "--published",
        nargs="?",
        const="",
        metavar="FILE",
        help="published end-to-end measurements (default: the committed "
        "tspbench/projection/published.json), each on its own preset; judges the model only",
    )
    pc.add_argument(
        "--hardware", default=None, help="with --summary or --records: that machine's preset"
    )
    pc.add_argument("--out", type=out_file(), default=None, help="Markdown table")
    pc.add_argument("--csv", type=out_file(), default=None)
    pc.set_defaults(func=cmd_project_check)

    pr = sub.add_parser("projected-report", help="projected paper-scale tables and figures")
    pr.add_argument("--config", default="workflows/config/projected.yaml")
    pr.add_argument("--estimates", required=True, help="folder of estimate JSONs")
    pr.add_argument("--out", type=out_dir, required=True)
    pr.add_argument("--plots", type=out_dir, required=True)
    pr.set_defaults(func=cmd_projected_report)

    c = sub.add_parser("calibrate", help="microbenchmark this machine into a hardware preset")
    c.add_argument("--ranks", default="1,2,4", help="rank counts to measure with")
    c.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    c.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    c.add_argument("--out", type=out_file(".json"), required=True, help="preset JSON to write")
    c.set_defaults(func=cmd_calibrate)
