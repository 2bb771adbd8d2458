"""The ``tspbench`` command line. Bad input exits 2 with one line naming the field and the rule."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import Any

from tspbench.core.config import ConfigError, get_config, parse_overrides
from tspbench.core.strategy import Layout

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        print(f"tspbench: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def size_bytes(text: str) -> int:
    """'512M', '2G', '1.5GiB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 512M or 2G")
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2).upper()]
    value = int(float(m.group(1)) * scale)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive")
    return value


def _int_in(lo: int, hi: int = 2**24):
    """An integer argument in [lo, hi] (the upper bound catches typos such as 10**12)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: must be an integer") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{text!r}: must be between {lo} and {hi}")
        return v

    return parse


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number") from None
    if not 0 < v <= 7 * 86400:
        raise argparse.ArgumentTypeError(
            f"{text!r}: must be a positive number of seconds (<= 1 week)"
        )
    return v


def add_run_args(p: argparse.ArgumentParser, strategy: str | None = None) -> None:
    """The arguments that define a run (``strategy``: a default, else --strategy is required)."""
    from tspbench.registry import strategies

    p.add_argument(
        "--strategy", required=strategy is None, default=strategy, choices=sorted(strategies())
    )
    p.add_argument("--model", default="tiny", help="preset: tiny, small, 7b")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a model field, e.g. --set kv_heads=4 (repeatable)",
    )
    p.add_argument("--seq-len", type=_int_in(1), required=True)
    p.add_argument(
        "--degree",
        type=_int_in(1, 65536),
        default=None,
        help="D, ranks in one model group (tpsp: defaults to tp x sp)",
    )
    p.add_argument("--tp", type=_int_in(1, 65536), default=1, help="T (tpsp)")
    p.add_argument("--sp", type=_int_in(1, 65536), default=1, help="Sigma (tpsp)")
    p.add_argument("--dp", type=_int_in(1, 65536), default=1, help="model replicas")
    p.add_argument("--mode", choices=("train", "infer"), default="train")
    p.add_argument("--batch", type=_int_in(1, 4096), default=1, help="micro-batch per replica")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--warmup", type=_int_in(0, 1000), default=1)
    p.add_argument("--steps", type=_int_in(1, 1000), default=3)
    p.add_argument("--seed", type=_int_in(0, 2**31 - 1), default=0)
    p.add_argument(
        "--recompute",
        choices=("none", "full"),
        default="none",
        help="activation checkpointing per layer (every strategy)",
    )
    p.add_argument(
        "--overlap",
        choices=("on", "off"),
        default="on",
        help="tsp: prefetch the next weight shard while computing (off: measure it)",
    )
    p.add_argument(
        "--kv-bucket",
        type=_int_in(0, 65536),
        default=0,
        help="tsp: KV heads per attention bucket (0: whole head group)",
    )
    p.add_argument(
        "--max-memory",
        type=size_bytes,
        default=None,
        help="per-rank budget for tracked live bytes; exceeding it is an OOM",
    )


def build_spec(a: argparse.Namespace):
    """Validate every input and return the RunSpec (ConfigError names the field and the rule)."""
    from tspbench.measure import RunSpec
    from tspbench.registry import get_strategy

    cfg = get_config(a.model, **parse_overrides(a.set))
    if a.strategy == "tpsp":
        degree = a.degree if a.degree is not None else a.tp * a.sp
    else:
        if a.tp != 1 or a.sp != 1:
            raise ConfigError(f"--tp/--sp: only strategy tpsp takes them (got {a.strategy})")
        degree = a.degree if a.degree is not None else 1
    layout = Layout(degree=degree, tp=a.tp, sp=a.sp, dp=a.dp)
    get_strategy(a.strategy).validate(cfg, layout, a.seq_len, a.batch, kv_bucket=a.kv_bucket)
    return RunSpec(
        strategy=a.strategy,
        cfg=cfg,
        layout=layout,
        seq_len=a.seq_len,
        batch=a.batch,
        mode=a.mode,
        dtype=a.dtype,
        warmup=a.warmup,
        steps=a.steps,
        seed=a.seed,
        max_memory=a.max_memory,
        quiet=a.quiet,
        recompute=a.recompute,
        overlap=a.overlap == "on",
        kv_bucket=a.kv_bucket,
    )


def check_out(path: str) -> None:
    if not path.endswith(".json"):
        raise ConfigError(f"--out={path!r}: must name a .json file")
    parent = Path(path).resolve().parent
    if parent.exists() and not os.access(parent, os.W_OK):
        raise ConfigError(f"--out={path!r}: directory {parent} is not writable")


def record_header(spec, launcher: str, world: int) -> dict[str, Any]:
    lay = spec.layout
    return {
        "strategy": spec.strategy,
        "model": spec.cfg.name,
        "seq_len": spec.seq_len,
        "degree": lay.degree,
        "tp": lay.tp if spec.strategy == "tpsp" else None,
        "sp": lay.sp if spec.strategy == "tpsp" else None,
        "dp": lay.dp,
        "world_size": world,
        "mode": spec.mode,
        "batch": spec.batch,
        "global_batch": spec.batch * lay.dp,
        "dtype": spec.dtype,
        "warmup": spec.warmup,
        "steps": spec.steps,
        "seed": spec.seed,
        "max_memory": spec.max_memory,
        "recompute": spec.recompute,
        "overlap": spec.overlap,
        "kv_bucket": spec.kv_bucket,
        "model_config": dataclasses.asdict(spec.cfg),
        "launcher": launcher,
    }


def cmd_run(a: argparse.Namespace) -> int:
    spec = build_spec(a)
    check_out(a.out)
    if a.launch == "local":
        return run_local(a, spec)
    from tspbench.run import run_env

    return run_env(spec, a.out, a.timeout, time_limit_s=a.time_limit)


def cmd_overlap(a: argparse.Namespace) -> int:
    spec = build_spec(a)
    check_out(a.out)
    if spec.strategy != "tsp":
        raise ConfigError(f"--strategy={spec.strategy}: the overlap benchmark measures tsp")
    if a.launch == "local":
        return run_local(a, spec)
    import torch.distributed as dist

    from tspbench.overlap_bench import bench_rank
    from tspbench.run import run_env

    def work(spec, device, header, beat):
        t = bench_rank(spec, device)
        if not spec.quiet and dist.get_rank() == 0:
            print(
                "[tspbench] "
                + ", ".join(
                    f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in t.items()
                ),
                flush=True,
            )
        return t

    return run_env(spec, a.out, a.timeout, work)


def run_local(a: argparse.Namespace, spec) -> int:
    """Spawn the ranks here and make sure a record exists afterwards: rank 0's, amended with what
    only the launcher saw (which rank died of which signal, a signal sent to the launcher)."""
    import json
    import signal

    from tspbench.launch import spawn_local
    from tspbench.record import utc_now, write_json

    world = spec.layout.world_size
    nproc = a.nproc if a.nproc is not None else world
    if nproc != world:
        raise ConfigError(f"--nproc={nproc}: must equal degree x dp = {world}")
    argv = [x for x in sys.argv[1:]]
    argv = _replace_flag(argv, "--launch", "env")
    out = Path(a.out)
    before = out.stat().st_mtime_ns if out.exists() else None
    codes, got = spawn_local(argv, nproc)
    fresh = out.exists() and out.stat().st_mtime_ns != before
    killed = {r: -c for r, c in enumerate(codes) if c < 0}
    died = "; ".join(f"rank {r} killed by {signal.Signals(s).name}" for r, s in killed.items())
    if got is not None:  # the launcher itself was signalled, perhaps before any rank's guard
        interrupted = f"interrupted by {signal.Signals(got).name} (sent to the launcher)"
        rec = json.loads(out.read_text()) if fresh else {}
        if "interrupted by" not in str(rec.get("error_message")):
            rec = {
                **record_header(spec, "local", world),
                "status": "error",
                "error_message": f"{interrupted}; {died}" if died else interrupted,
                "timestamp_utc": utc_now(),
            }
        write_json(out, {**rec, "rank_exit_codes": codes})
        return 128 + got
    if not fresh:  # rank 0 died before writing: the launcher leaves the record instead
        write_json(
            out,
            {
                **record_header(spec, "local", world),
                "status": "error",
                "error_message": died or f"rank 0 wrote no record (exit codes {codes})",
                "rank_exit_codes": codes,
                "timestamp_utc": utc_now(),
            },
        )
        return 1
    if killed:  # the launcher alone saw which rank died: add it to the record
        rec = json.loads(out.read_text())
        rec["rank_exit_codes"] = codes
        if rec.get("status") == "error":
            rec["error_message"] = f"{died}; rank 0 saw: {rec.get('error_message')}"
        write_json(out, rec)
    return 0 if codes[0] == 0 else 1


def _replace_flag(argv: list[str], flag: str, value: str) -> list[str]:
    out, skip = [], False
    for i, x in enumerate(argv):
        if skip:
            skip = False
            continue
        if x == flag:
            skip = i + 1 < len(argv)
            continue
        if x.startswith(flag + "="):
            continue
        out.append(x)
    return out + [flag, value]


def make_parser() -> Parser:
    from tspbench.registry import strategies

    p = Parser(prog="tspbench", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    r = sub.add_parser("run", help="one measured run, written as a JSON record")
    add_run_args(r)
    add_launch_args(r)
    r.set_defaults(func=cmd_run)
    o = sub.add_parser("overlap", help="how much of TSP's communication hides behind compute")
    add_run_args(o, strategy="tsp")
    add_launch_args(o)
    o.set_defaults(func=cmd_overlap)
    lay = sub.add_parser("layout", help="list model and data-parallel groups, flag node crossings")
    lay.add_argument("--world", type=_int_in(1, 65536), required=True)
    lay.add_argument("--gpus-per-node", type=_int_in(1, 65536), required=True)
    lay.add_argument("--strategy", required=True, choices=sorted(strategies()))
    lay.add_argument("--degree", type=_int_in(1, 65536), default=None)
    lay.add_argument("--tp", type=_int_in(1, 65536), default=1)
    lay.add_argument("--sp", type=_int_in(1, 65536), default=1)
    lay.add_argument("--json", action="store_true", help="print the groups as JSON")
    lay.set_defaults(func=cmd_layout)
    cc = sub.add_parser("check-config", help="validate a sweep config (schema and sweep rules)")
    cc.add_argument("config", help="YAML file, e.g. workflows/config/paper.yaml")
    cc.set_defaults(func=cmd_check_config)
    cr = sub.add_parser("check-record", help="validate a run record against its schema")
    cr.add_argument("record")
    cr.set_defaults(func=cmd_check_record)
    rg = sub.add_parser(
        "regress", help="compare an aggregate table with a baseline; exit 1 on regression"
    )
    rg.add_argument(
        "--current",
        required=True,
        nargs="+",
        help="aggregate CSV of this run (with --update: one or more repeats)",
    )
    rg.add_argument(
        "--baseline",
        default=None,
        help="baseline CSV (default: results/baselines/<hardware id>.csv)",
    )
    rg.add_argument("--tolerances", default="workflows/regress.yaml")
    rg.add_argument("--out", default=None, help="also write the Markdown report here")
    rg.add_argument(
        "--update",
        action="store_true",
        help="make --current the new baseline (per-cell median of several repeats)",
    )
    rg.set_defaults(func=cmd_regress)
    ag = sub.add_parser("aggregate", help="run records of a sweep -> one table (CSV, Parquet)")
    ag.add_argument("--config-json", required=True, help="the sweep config, as JSON")
    ag.add_argument("--runs", required=True, help="folder of <cell>.json records")
    ag.add_argument("--csv", required=True)
    ag.add_argument("--parquet", default=None)
    ag.add_argument("--filtered", required=True, help="CSV of filtered combinations and reasons")
    ag.set_defaults(func=cmd_aggregate)
    for name, func, what in (
        ("tables", cmd_tables, "Markdown and LaTeX tables"),
        ("figures", cmd_figures, "PNG and PDF figures"),
    ):
        t = sub.add_parser(name, help=f"aggregate table -> {what}")
        t.add_argument("--summary", required=True, help="the aggregate CSV")
        t.add_argument("--out", required=True)
        t.add_argument("--note", default="", help="appended to every caption/title")
        t.set_defaults(func=func)
    from tspbench.scale_cli import add_parsers

    add_parsers(sub, add_run_args)
    return p


def cmd_layout(a: argparse.Namespace) -> int:
    import json

    from tspbench.layout import describe, rank_layout

    degree = a.degree if a.degree is not None else (a.tp * a.sp if a.strategy == "tpsp" else 1)
    if a.world % degree:
        raise ConfigError(f"--world={a.world}: must be a multiple of the model group ({degree})")
    layout = Layout(degree=degree, tp=a.tp, sp=a.sp, dp=a.world // degree)
    if a.strategy == "tpsp" and a.tp * a.sp != degree:
        raise ConfigError(f"tp={a.tp} x sp={a.sp}: must equal degree={degree}")
    lay = rank_layout(a.strategy, layout)
    if a.json:
        print(json.dumps({**lay.as_dict(), "crossing": lay.crossing(a.gpus_per_node)}))
    else:
        print(describe(lay, a.gpus_per_node))
    return 0


def add_launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="record path (.json), written atomically")
    p.add_argument(
        "--launch",
        choices=("env", "local"),
        default="env",
        help="env: ranks from torchrun/Slurm/MPI; local: spawn --nproc ranks here",
    )
    p.add_argument("--nproc", type=_int_in(1, 65536), default=None)
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=300.0,
        help="seconds a collective may wait before the run is declared hung",
    )
    p.add_argument(
        "--time-limit",
        type=_positive_float,
        default=None,
        help="seconds the whole run may take; then it stops and records why",
    )
    p.add_argument("--quiet", action="store_true")


def cmd_aggregate(a: argparse.Namespace) -> int:
    import json

    import pandas as pd

    from tspbench.pipeline.aggregate import aggregate, write_table
    from tspbench.pipeline.cells import sweep_cells

    cells, filtered = sweep_cells(json.loads(a.config_json))
    df = aggregate(cells, Path(a.runs))
    write_table(df, Path(a.csv), Path(a.parquet) if a.parquet else None)
    write_table(
        pd.DataFrame(filtered, columns=["cell", "reason"] if not filtered else None),
        Path(a.filtered),
    )
    counts = ", ".join(f"{n} {s}" for s, n in df["status"].value_counts().items())
    print(f"{len(df)} cells ({counts}); {len(filtered)} combinations filtered")
    bad = df[df["status"] != "ok"]
    for _, r in bad.iterrows():
        print(f"  {r['cell']}: {r['status']}: {r.get('error_message')}")
    return 0


def _summary(path: str):
    import pandas as pd

    try:
        return pd.read_csv(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--summary={path!r}: cannot read the aggregate table ({e})") from None


def cmd_tables(a: argparse.Namespace) -> int:
    from tspbench.pipeline.tables import write_tables

    for p in write_tables(_summary(a.summary), Path(a.out), a.note):
        print(p)
    return 0


def cmd_figures(a: argparse.Namespace) -> int:
    from tspbench.pipeline.figures import write_figures

    for p in write_figures(_summary(a.summary), Path(a.out), a.note):
        print(p)
    return 0


def cmd_check_config(a: argparse.Namespace) -> int:
    from tspbench.pipeline.cells import load_config, sweep_cells

    cells, filtered = sweep_cells(load_config(a.config))
    print(f"{a.config}: valid; {len(cells)} cells, {len(filtered)} combinations filtered")
    for f in filtered:
        print(f"  filtered {f['cell']}: {f['reason']}")
    return 0


def cmd_check_record(a: argparse.Namespace) -> int:
    import json

    import jsonschema

    schema = json.loads((Path(__file__).parent / "schemas/record.schema.json").read_text())
    try:
        rec = json.loads(Path(a.record).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"record {a.record!r}: not readable JSON ({e})") from None
    try:
        jsonschema.validate(rec, schema)
    except jsonschema.ValidationError as e:
        where = ".".join(map(str, e.absolute_path)) or "(top level)"
        raise ConfigError(f"record {a.record!r}: {where}: {e.message}") from None
    print(f"{a.record}: valid record, status {rec['status']}")
    return 0


def cmd_regress(a: argparse.Namespace) -> int:

    from tspbench import regress
    from tspbench.record import git_commit, utc_now, versions, write_atomic, write_json

    baseline = Path(a.baseline or f"results/baselines/{regress.hardware_id()}.csv")
    tables = [regress.read_table(c, "current") for c in a.current]
    tol = regress.load_tolerances(a.tolerances)
    if a.update:
        current = regress.median_table(tables, tol["exact"])
        write_atomic(baseline, current.reset_index().to_csv(index=False))
        write_json(
            baseline.with_suffix(".json"),
            {
                "hardware_id": regress.hardware_id(),
                "device_name": current["device_name"].iloc[0],
                "cpu_count": os.cpu_count(),
                "versions": versions(None),
                "git_commit": git_commit(),
                "created_utc": utc_now(),
                "source": [str(c) for c in a.current],
                "repeats": len(tables),
                "cells": len(current),
            },
        )
        print(f"baseline updated: {baseline} ({len(current)} cells)")
        return 0
    if not baseline.exists():
        raise ConfigError(
            f"--baseline={str(baseline)!r}: no baseline for this hardware; create one with "
            f"tspbench regress --update --current {a.current}"
        )
    if len(tables) != 1:
        raise ConfigError("--current: compare one table at a time (several only with --update)")
    base = regress.read_table(baseline, "baseline")
    findings = regress.compare(base, tables[0], tol)
    text = regress.report(findings, len(base))
    print(text)
    if a.out:
        write_atomic(a.out, text)
    bad = [f for f in findings if f.verdict in ("regression", "missing", "failed")]
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    from tspbench.guard import release_signals

    args = make_parser().parse_args(argv)
    if args.func not in (cmd_run, cmd_overlap):  # no guard or launcher will take the signals
        release_signals()
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"tspbench: error: {e}", file=sys.stderr)
        return EXIT_USAGE
