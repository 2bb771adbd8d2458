"""Compare a sweep's aggregate table with a committed baseline, cell by cell, metric by metric.

Deterministic metrics (bytes per collective kind, parameter and optimizer elements, FLOPs) must
match exactly. Measured metrics (the tracked peak memory) may move within a relative tolerance,
widened to ``spread_factor`` x the cell's spread over the baseline's repeats (the baseline is the
per-cell median of several repeats); beyond ``notice_tolerance`` but within its tolerance a cell
is reported (``slower``, or an ``improvement``) without failing. None of them depends on the machine
(the CI sweep runs on CPUs), so one baseline serves every machine. Timings are not compared with
a table recorded elsewhere: :mod:`tspbench.pipeline.ab` times the baseline commit's code and
this code side by side on one machine.
A cell missing from the current table, or failing where it used to succeed, is a regression, and
so is a NaN or infinite number in a cell that claims success (``corrupt``); a new cell is reported.
Exit codes: 0 clean, 1 any regression, 2 unusable input (unreadable or malformed tables, missing
columns, tolerances that are not finite and >= 0).
"""

from __future__ import annotations

import csv
import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from tspbench.core.config import ConfigError, read_input


@dataclass
class Finding:
    cell: str
    metric: str
    baseline: object
    current: object
    verdict: str  # regression|improvement|slower|missing|new|failed|corrupt

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


BAD = ("regression", "missing", "failed", "corrupt")  # verdicts that fail the check (exit 1)


def read_table(path: str | Path, what: str, metrics: tuple[str, ...] = ()) -> pd.DataFrame:
    """An aggregate table indexed by cell, its ``metrics`` columns numbers (an inf stays inf, for
    :func:`compare` to flag); anything unusable is a one-line ConfigError (exit 2, never 1)."""
    text = read_input(path, f"--{what}")
    try:
        df = pd.read_csv(io.StringIO(text))
        short = _short_row(text)
    except (OSError, ValueError, csv.Error) as e:  # UnicodeDecodeError, parser errors included
        text = str(e).replace("\n", " ")
        raise ConfigError(f"--{what}={str(path)!r}: cannot read the table ({text})") from None
    if short:
        raise ConfigError(f"--{what}={str(path)!r}: {short} (a file cut short?)")
    if df.empty:
        raise ConfigError(f"--{what}={str(path)!r}: holds no cells: nothing to compare")
    if not isinstance(df.index, pd.RangeIndex):  # pandas makes the surplus fields an index
        raise ConfigError(f"--{what}={str(path)!r}: rows with more fields than the header")
    for col in ("cell", "status"):
        if col not in df.columns:
            raise ConfigError(f"--{what}={str(path)!r}: not an aggregate table (no {col!r} column)")
    if df["cell"].isna().any() or df["cell"].duplicated().any():
        raise ConfigError(f"--{what}={str(path)!r}: empty or duplicate cells")
    for m in (m for m in metrics if m in df.columns):
        numbers = pd.to_numeric(df[m], errors="coerce")
        if (wrong := df[m][numbers.isna() & df[m].notna()]).any():
            raise ConfigError(
                f"--{what}={str(path)!r}: column {m}: {wrong.iloc[0]!r} is not a number"
            )
        df[m] = numbers
    return df.set_index("cell")


def _short_row(text: str) -> str | None:
    """The first row with fewer fields than the header, said in words (pandas fills the missing
    ones with NaN: a baseline cut mid-row would read as regressions of every metric it lost)."""
    rows = csv.reader(io.StringIO(text, newline=""))
    width = len(next(rows, []))
    for i, row in enumerate(rows, start=2):
        if row and len(row) < width:
            return f"row {i} has {len(row)} fields, the header {width}"
    return None


def check_judged(df: pd.DataFrame, tol: dict, what: str) -> None:
    """A table the gate may trust: in every ``ok`` cell each judged measurement is finite and
    positive, each exact count finite and not negative (absent is fine: a kind of collective the
    strategy never calls). A baseline of zeros or NaNs would otherwise pass every cell."""
    ok = df[df["status"] == "ok"]
    for m in (m for m in metrics(tol) if m in ok.columns):
        v = pd.to_numeric(ok[m], errors="coerce")
        exact = m in tol["exact"]
        bad = v.abs().eq(math.inf) | (v.lt(0) if exact else ~v.gt(0))
        if bad.any():
            cell, value = v[bad].index[0], v[bad].iloc[0]
            rule = "finite and >= 0" if exact else "finite and > 0"
            raise ConfigError(f"--{what}: cell {cell}: {m} = {value}: must be {rule}")


def load_tolerances(path: str | Path) -> dict:
    """The tolerances, checked against their schema: a NaN or negative tolerance would make every
    comparison pass, so it is refused (exit 2) instead of silently disabling the gate."""
    from tspbench.pipeline.cells import check_schema, read_yaml

    tol = read_yaml(path, "--tolerances")
    check_schema(tol, "regress.schema.yaml", f"--tolerances={str(path)!r}")
    return tol


def metrics(tol: dict) -> tuple[str, ...]:
    """Every column the tolerances compare."""
    return (*tol["exact"], *tol["relative"])


def _num(v: Any) -> float | None:
    """A table cell as a number (None: missing, NaN or not a number)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def compare(base: pd.DataFrame, cur: pd.DataFrame, tol: dict) -> list[Finding]:
    """Every finding, cell by cell, then the medians (a column the baseline compares but the
    current table lacks is unusable input, not a regression of every cell)."""
    if lost := [m for m in metrics(tol) if m in base.columns and m not in cur.columns]:
        raise ConfigError(f"--current: no {', '.join(lost)} column(s), which the baseline has")
    check_judged(base, tol, "baseline")
    out: list[Finding] = []
    for cell in base.index:
        b = base.loc[cell]
        if cell not in cur.index:
            out.append(Finding(cell, "cell", "present", "missing", "missing"))
            continue
        c = cur.loc[cell]
        if b["status"] == "ok" and c["status"] != "ok":
            out.append(Finding(cell, "status", b["status"], c["status"], "failed"))
        elif b["status"] != "ok" or c["status"] != "ok":
            if b["status"] != c["status"]:
                out.append(Finding(cell, "status", b["status"], c["status"], "improvement"))
        else:
            out += cell_findings(cell, b, c, tol)
    out += [
        Finding(cell, "cell", "absent", "present", "new")
        for cell in cur.index
        if cell not in base.index
    ]
    return out


def cell_findings(cell: str, b: pd.Series, c: pd.Series, tol: dict) -> list[Finding]:
    """One cell that succeeded in both tables, metric by metric: a NaN or infinite current value
    is ``corrupt`` (never an improvement), exact metrics must match, measured ones stay within
    the larger of the tolerance and ``spread_factor`` x the cell's own spread."""
    out = []
    for metric in (m for m in metrics(tol) if m in b.index):
        bv, cv = _num(b[metric]), _num(c[metric])
        if bv is not None and (cv is None or math.isinf(cv)):
            out.append(Finding(cell, metric, bv, c[metric], "corrupt"))
        elif metric in tol["exact"]:
            if (bv or 0.0) != (cv or 0.0):
                out.append(Finding(cell, metric, bv or 0.0, cv or 0.0, "regression"))
        elif bv is not None:
            assert cv is not None  # (a missing current value is corrupt, above)
            rule = tol["relative"][metric]
            change = (cv - bv) / abs(bv) if bv else 0.0
            worse = change if rule["worse"] == "higher" else -change
            limit = rule["tolerance"]
            spread = _num(b.get(f"{metric}_spread"))
            if spread is not None and "spread_factor" in rule:  # this cell's own measured noise
                limit = max(limit, rule["spread_factor"] * spread)
            notice = rule.get("notice_tolerance", rule["tolerance"])
            if worse > limit:
                out.append(Finding(cell, metric, bv, cv, "regression"))
            elif worse > notice:
                out.append(Finding(cell, metric, bv, cv, "slower"))
            elif worse < -notice:
                out.append(Finding(cell, metric, bv, cv, "improvement"))
    return out


def report(findings: list[Finding], n_cells: int) -> str:
    bad = [f for f in findings if f.verdict in BAD]
    head = (
        f"**Regression check**: {n_cells} baseline cells, {len(bad)} regression(s), "
        f"{sum(f.verdict == 'improvement' for f in findings)} improvement(s), "
        f"{sum(f.verdict == 'slower' for f in findings)} notice(s), "
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
    """Where a baseline was recorded (its provenance): the GPU model, else the CPU count."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0).lower().replace(" ", "-")
    return f"cpu-{os.cpu_count()}c"
