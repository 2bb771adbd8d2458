"""The pipeline's commands: ``aggregate``, ``tables``, ``figures``, ``check-config``,
``check-record``, ``regress`` and ``regress-ab``. Argument handling only; the work is in
tspbench.pipeline."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tspbench.cli.args import out_dir, out_file
from tspbench.core.config import ConfigError, read_csv_input


def cmd_aggregate(args: argparse.Namespace) -> int:
    from tspbench.pipeline.aggregate import report, write_summary

    parquet = Path(args.parquet) if args.parquet else None
    runs, csv, filtered = Path(args.runs), Path(args.csv), Path(args.filtered)
    df, cut = write_summary(json.loads(args.config_json), runs, csv, parquet, filtered)
    print(report(df, cut))
    return 0


def _summary(path: str):
    return read_csv_input(path, "--summary")


def cmd_tables(args: argparse.Namespace) -> int:
    from tspbench.pipeline.tables import write_tables

    for p in write_tables(_summary(args.summary), Path(args.out), args.note):
        print(p)
    return 0


def cmd_figures(args: argparse.Namespace) -> int:
    from tspbench.pipeline.figures import write_figures

    for p in write_figures(_summary(args.summary), Path(args.out), args.note):
        print(p)
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    from tspbench.pipeline.cells import load_config, sweep_cells

    cells, filtered = sweep_cells(load_config(args.config), f"config {args.config!r}")
    print(f"{args.config}: valid; {len(cells)} cells, {len(filtered)} combinations filtered")
    for f in filtered:
        print(f"  filtered {f['cell']}: {f['reason']}")
    return 0


def cmd_check_record(args: argparse.Namespace) -> int:
    from tspbench.runtime.record import check_record

    rec = check_record(args.record)
    print(f"{args.record}: valid record, status {rec['status']}")
    return 0


def cmd_regress(args: argparse.Namespace) -> int:
    """Exit 0 clean, 1 regression, 2 unusable input: an error the checks did not foresee is
    still unusable input (one line, exit 2), never a traceback whose exit 1 reads as a
    regression."""
    try:
        return _regress(args)
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError, ArithmeticError, OSError) as e:
        raise ConfigError(f"regress: unusable input ({type(e).__name__}: {e})") from None


def _regress(args: argparse.Namespace) -> int:
    from tspbench.pipeline import regress
    from tspbench.pipeline.baseline import update_baseline
    from tspbench.runtime.record import write_atomic

    baseline = Path(args.baseline)
    tol = regress.load_tolerances(args.tolerances)
    tables = [regress.read_table(c, "current", regress.metrics(tol)) for c in args.current]
    if args.update:
        n = update_baseline(baseline, tables, tol, args.current)
        print(f"baseline updated: {baseline} ({n} cells)")
        return 0
    if not baseline.exists():
        raise ConfigError(
            f"--baseline={str(baseline)!r}: no such baseline; create one with "
            f"tspbench regress --update --current {args.current}"
        )
    if len(tables) != 1:
        raise ConfigError("--current: compare one table at a time (several only with --update)")
    base = regress.read_table(baseline, "baseline", regress.metrics(tol))
    findings = regress.compare(base, tables[0], tol)
    text = regress.report(findings, len(base))
    print(text)
    if args.out:
        write_atomic(args.out, text)
    return 1 if any(f.verdict in regress.BAD for f in findings) else 0


def cmd_regress_ab(args: argparse.Namespace) -> int:
    """Exit 0 clean, 1 regression, 2 unusable input (as ``regress``)."""
    import tempfile

    import tspbench
    from tspbench.pipeline import ab, regress
    from tspbench.runtime.record import write_atomic

    commit_file = Path(args.commit_file)
    top = ab.git(Path.cwd(), "rev-parse", "--show-toplevel")
    if top.returncode:
        raise ConfigError(f"{Path.cwd()}: not in a git clone: the baseline commit lives in one")
    root = Path(top.stdout.decode().strip())
    if args.update:
        print(f"baseline commit: {ab.write_commit(root, commit_file)} ({commit_file})")
        return 0
    rule = regress.load_tolerances(args.tolerances).get("ab")
    if rule is None:
        raise ConfigError(f"--tolerances={args.tolerances!r}: no ab section")
    cells, config = ab.load_cells(args.config)
    commit = ab.read_commit(commit_file)
    with tempfile.TemporaryDirectory(prefix="tspbench-ab.") as tmp:
        work = Path(args.work).resolve() if args.work else Path(tmp)  # runs start elsewhere
        work.mkdir(parents=True, exist_ok=True)
        a, b = ab.sides(
            ab.extract(root, commit, Path(tmp) / "baseline"),
            Path(tspbench.__file__).resolve().parents[1],
        )
        print(f"A/B: baseline {commit[:12]} against the code at {b.tree}", flush=True)
        trial = ab.Trial(config, a, b, work, log=lambda line: print(line, flush=True))
        judged, level, bad = ab.check(trial, cells, rule)
    text = ab.report(judged, trial.failed, level, bad, rule)
    print(text)
    if args.out:
        write_atomic(args.out, text)
    return 1 if bad or trial.failed or any(c.verdict == "regression" for c in judged) else 0


def cmd_claims(args: argparse.Namespace) -> int:
    from tspbench.pipeline.claims import CLAIMS, Sources, claims_table, write_claims

    path = Path(args.claims) if args.claims else CLAIMS
    if not path.is_file():
        raise ConfigError(f"--claims={str(path)!r}: no such file")
    src = Sources.find()
    if args.measured:
        src.measured = Path(args.measured).resolve()
    if args.projected:
        src.projected = Path(args.projected).resolve()
    options = (
        ("--measured", src.measured, args.measured),
        ("--projected", src.projected, args.projected),
    )
    missing = [(what, where, given) for what, where, given in options if not where.exists()]
    if missing:  # both at once; a default lies under the current directory: say so
        said = "; ".join(
            f"{what}={str(where)!r}: no such file or folder" for what, where, _ in missing
        )
        defaults = " and ".join(what for what, _, given in missing if not given)
        hint = f" (defaults are under the current directory: run in a checkout or give {defaults})"
        raise ConfigError(said + (hint if defaults else ""))
    df = claims_table(path, src)
    text = write_claims(
        df, Path(args.out) if args.out else None, Path(args.md) if args.md else None
    )
    print(text)
    return 0


def add_parsers(sub) -> None:
    cl = sub.add_parser("claims", help="the paper's claims against ours, one row per claim")
    cl.add_argument(
        "--claims",
        default=None,
        help="claims YAML (default: the paper's, tspbench/data/claims.yaml)",
    )
    cl.add_argument(
        "--out", type=out_file(), default=None, help="CSV: claim, paper, ours, verdict, reason, ..."
    )
    cl.add_argument(
        "--md", type=out_file(), default=None, help="also write the Markdown table here"
    )
    cl.add_argument(
        "--measured",
        default=None,
        help="an aggregate summary.csv (default, under the current directory: fresh "
        "results/default, else the committed CPU reference)",
    )
    cl.add_argument(
        "--projected",
        default=None,
        help="folder of projected tables (default, under the current directory: "
        "fresh results/projected, else results/reference/projected-7b)",
    )
    cl.set_defaults(func=cmd_claims)
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
        default="results/baselines/ci.csv",
        help="baseline CSV (default: the CI sweep's; the same on every machine)",
    )
    rg.add_argument("--tolerances", default="workflows/regress.yaml")
    rg.add_argument(
        "--out", type=out_file(), default=None, help="also write the Markdown report here"
    )
    rg.add_argument(
        "--update",
        action="store_true",
        help="make --current the new baseline (per-cell median of several repeats)",
    )
    rg.set_defaults(func=cmd_regress)
    ab = sub.add_parser(
        "regress-ab",
        help="time cells with the baseline commit's code and this code, interleaved; "
        "exit 1 on a slowdown",
    )
    ab.add_argument("--config", default="workflows/config/ab.yaml", help="the cells (a sweep)")
    ab.add_argument("--tolerances", default="workflows/regress.yaml", help="its ab section")
    ab.add_argument(
        "--commit-file",
        default="results/baselines/ab.json",
        help="names the baseline commit (in this git clone)",
    )
    ab.add_argument("--work", default=None, help="keep the runs' records here")
    ab.add_argument(
        "--out", type=out_file(), default=None, help="also write the Markdown report here"
    )
    ab.add_argument(
        "--update", action="store_true", help="name HEAD as the baseline commit (code committed)"
    )
    ab.set_defaults(func=cmd_regress_ab)
    ag = sub.add_parser("aggregate", help="run records of a sweep -> one table (CSV, Parquet)")
    ag.add_argument("--config-json", required=True, help="the sweep config, as JSON")
    ag.add_argument("--runs", required=True, help="folder of <cell>.json records")
    ag.add_argument("--csv", type=out_file(".csv"), required=True)
    ag.add_argument("--parquet", type=out_file(), default=None)
    ag.add_argument(
        "--filtered",
        type=out_file(),
        required=True,
        help="CSV of filtered combinations and reasons",
    )
    ag.set_defaults(func=cmd_aggregate)
    for name, func, what in (
        ("tables", cmd_tables, "Markdown and LaTeX tables"),
        ("figures", cmd_figures, "PNG and PDF figures"),
    ):
        t = sub.add_parser(name, help=f"aggregate table -> {what}")
        t.add_argument("--summary", required=True, help="the aggregate CSV")
        t.add_argument("--out", type=out_dir, required=True)
        t.add_argument("--note", default="", help="appended to every caption/title")
        t.set_defaults(func=func)
