"""Compare a sweep's aggregate table with a committed baseline, cell by cell, metric by metric.

Deterministic metrics (bytes per collective kind, parameter and optimizer elements, FLOPs) must
match exactly. Measured peak memory may move within a small relative tolerance. Throughput is
compared as ``tokens_per_s_per_gflops`` (tokens/s over a GEMM rate sampled before every
timed step on the same ranks), which cancels the machine's speed and load; each is a median over
the run's timed steps, and the baseline is the per-cell median of several repeats, which also
records each cell's spread: a cell's tolerance is the larger of the configured one and
``spread_factor`` x its own spread. Per-cell noise averages out in the median over all cells
(and over each strategy's cells), which is checked with tighter tolerances. A cell missing from
the current table, or failing where it used to succeed, is a regression; a new cell is reported.
Exit codes: 0 clean, 1 any regression, 2 unusable input.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from tspbench.core.config import ConfigError


@dataclass
class Finding:
    cell: str
    metric: str
    baseline: object
    current: object
    verdict: str  # regression | improvement | missing | new | failed

    def row(self) -> str:
        def fmt(v: object) -> str:
            return f"{v:.6g}" if isinstance(v, float) else str(v)

        change = ""
        if isinstance(self.baseline, (int, float)) and isinstance(self.current, (int, float)):
            if self.baseline:
                change = f"{(self.current - self.baseline) / abs(self.baseline):+.1%}"
        return (
            f"| {self.cell} | {self.metric} | {fmt(self.baseline)} | {fmt(self.current)} | "
            f"{change} | {self.verdict} |"
        )


def read_table(path: str | Path, what: str) -> pd.DataFrame:
    try:
        df = pd.read_csv(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--{what}={str(path)!r}: cannot read the table ({e})") from None
    for col in ("cell", "status"):
        if col not in df.columns:
            raise ConfigError(f"--{what}={str(path)!r}: not an aggregate table (no {col!r} column)")
    if df["cell"].duplicated().any():
        raise ConfigError(f"--{what}={str(path)!r}: duplicate cells")
    return df.set_index("cell")


def load_tolerances(path: str | Path) -> dict:
    try:
        tol = yaml.safe_load(Path(path).read_text())
        tol["exact"], tol["relative"]  # noqa: B018 (shape check)
    except (OSError, yaml.YAMLError, KeyError, TypeError) as e:
        raise ConfigError(f"--tolerances={str(path)!r}: unusable ({e})") from None
    return tol


def _num(v: object) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def compare(base: pd.DataFrame, cur: pd.DataFrame, tol: dict) -> list[Finding]:
    out: list[Finding] = []
    for cell in base.index:
        b = base.loc[cell]
        if cell not in cur.index:
            out.append(Finding(cell, "cell", "present", "missing", "missing"))
            continue
        c = cur.loc[cell]
        if b["status"] == "ok" and c["status"] != "ok":
            out.append(Finding(cell, "status", b["status"], c["status"], "failed"))
            continue
        if b["status"] != "ok" or c["status"] != "ok":
            if b["status"] != c["status"]:
                out.append(Finding(cell, "status", b["status"], c["status"], "improvement"))
            continue
        for metric in tol["exact"]:
            if metric in b.index:
                bv, cv = _num(b[metric]) or 0.0, _num(c.get(metric)) or 0.0
                if bv != cv:
                    out.append(Finding(cell, metric, bv, cv, "regression"))
        for metric, rule in tol["relative"].items():
            bv, cv = _num(b.get(metric)), _num(c.get(metric))
            if bv is None:
                continue
            if cv is None:
                out.append(Finding(cell, metric, bv, "none", "regression"))
                continue
            change = (cv - bv) / abs(bv) if bv else 0.0
            worse = change if rule["worse"] == "higher" else -change
            limit = rule["tolerance"]
            spread = _num(b.get(f"{metric}_spread"))
            if spread is not None and "spread_factor" in rule:  # this cell's own measured noise
                limit = max(limit, rule["spread_factor"] * spread)
            if worse > limit:
                out.append(Finding(cell, metric, bv, cv, "regression"))
            elif worse < -rule["tolerance"]:
                out.append(Finding(cell, metric, bv, cv, "improvement"))
    out += [
        Finding(cell, "cell", "absent", "present", "new")
        for cell in cur.index
        if cell not in base.index
    ]
    out += median_findings(base, cur, tol)
    return out


def median_findings(base: pd.DataFrame, cur: pd.DataFrame, tol: dict) -> list[Finding]:
    """Per-cell noise averages out in the median change over many cells, a real slowdown does
    not: metrics with a ``median_tolerance`` are also checked as the median of current/baseline
    over all cells and over each strategy's cells (these rows' values are ratios)."""
    both = [
        c
        for c in base.index
        if c in cur.index and base.loc[c, "status"] == "ok" and cur.loc[c, "status"] == "ok"
    ]
    out = []
    for metric, rule in tol["relative"].items():
        if "median_tolerance" not in rule or metric not in base.columns or not both:
            continue
        ratio = cur.loc[both, metric].astype(float) / base.loc[both, metric].astype(float)
        groups = {"(all cells)": (ratio, rule["median_tolerance"])}
        if "strategy" in base.columns and "strategy_median_tolerance" in rule:
            for s, idx in base.loc[both].groupby("strategy").groups.items():
                groups[f"(strategy {s})"] = (
                    ratio.loc[list(idx)],
                    rule["strategy_median_tolerance"],
                )
        for name, (r, limit) in groups.items():
            change = float(r.median()) - 1
            worse = change if rule["worse"] == "higher" else -change
            if worse > limit:
                out.append(Finding(name, f"median {metric}", 1.0, float(r.median()), "regression"))
    return out


def report(findings: list[Finding], n_cells: int) -> str:
    bad = [f for f in findings if f.verdict in ("regression", "missing", "failed")]
    head = (
        f"**Regression check**: {n_cells} baseline cells, {len(bad)} regression(s), "
        f"{sum(f.verdict == 'improvement' for f in findings)} improvement(s), "
        f"{sum(f.verdict == 'new' for f in findings)} new cell(s)\n"
    )
    if not findings:
        return head + "\nEvery cell matches the baseline within tolerance.\n"
    rows = [
        "| cell | metric | baseline | current | change | verdict |",
        "|---|---|---|---|---|---|",
    ]
    rows += [f.row() for f in sorted(findings, key=lambda f: (f.verdict != "regression", f.cell))]
    return head + "\n" + "\n".join(rows) + "\n"


def hardware_id() -> str:
    """Which baseline this machine compares against: the GPU model, else the CPU count.

    Coarse on purpose: throughput is compared normalised by the machine's own GEMM rate, so
    machines of one kind share a baseline.
    """
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0).lower().replace(" ", "-")
    return f"cpu-{os.cpu_count()}c"


MEASURED = (
    "peak_mem_bytes",
    "step_time_s",
    "step_time_min_s",
    "step_time_max_s",
    "tokens_per_s",
    "calib_gflops",
    "tokens_per_s_per_gflops",
    "mfu",
)


def median_table(tables: list[pd.DataFrame], exact: list[str]) -> pd.DataFrame:
    """One baseline from several repeats: per-cell medians of the measured metrics; deterministic
    metrics must agree across repeats (else the repeats are not of the same code)."""
    first = tables[0].copy()
    for t in tables[1:]:
        if set(t.index) != set(first.index):
            raise ConfigError("--current tables: the repeats do not hold the same cells")
        for m in exact:
            if m in first.columns and not first[m].fillna(0).equals(
                t.loc[first.index, m].fillna(0)
            ):
                raise ConfigError(f"--current tables: {m} differs between repeats")
    for m in MEASURED:
        if m in first.columns:
            values = pd.concat([t[m] for t in tables], axis=1)
            first[m] = values.median(axis=1)
            # the cell's noise across the repeats: largest relative distance from the median
            first[f"{m}_spread"] = values.div(first[m], axis=0).sub(1).abs().max(axis=1)
    return first


def update_baseline(baseline: Path, tables: list[pd.DataFrame], tol: dict, sources: list) -> int:
    """Make the per-cell median of ``tables`` the baseline, with its provenance beside it;
    returns the number of cells."""
    from tspbench.runtime.record import git_commit, utc_now, versions, write_atomic, write_json

    current = median_table(tables, tol["exact"])
    write_atomic(baseline, current.reset_index().to_csv(index=False))
    write_json(
        baseline.with_suffix(".json"),
        {
            "hardware_id": hardware_id(),
            "device_name": current["device_name"].iloc[0],
            "cpu_count": os.cpu_count(),
            "versions": versions(None),
            "git_commit": git_commit(),
            "created_utc": utc_now(),
            "source": [str(c) for c in sources],
            "repeats": len(tables),
            "cells": len(current),
        },
    )
    return len(current)
