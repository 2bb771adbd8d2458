"""Writing a baseline for :mod:`tspbench.pipeline.regress`: the per-cell median of repeats, with
its provenance, written as a pair (CSV and JSON) or not at all.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import pandas as pd

from tspbench.core.config import ConfigError
from tspbench.pipeline.regress import check_judged, hardware_id

MEASURED = ("peak_mem_bytes", "step_time_s", "step_time_min_s", "step_time_max_s", "tokens_per_s",
            "calib_gflops", "tokens_per_s_per_gflops", "mfu")  # fmt: skip


def median_table(tables: list[pd.DataFrame], exact: list[str]) -> pd.DataFrame:
    """One baseline from several repeats: per-cell medians of the measured metrics; deterministic
    metrics must agree across repeats (else the repeats are not of the same code)."""
    first = tables[0].copy()
    for t in tables[1:]:
        if set(t.index) != set(first.index):
            raise ConfigError("--current tables: the repeats do not hold the same cells")
        if lost := sorted({*exact, *MEASURED} & (set(first.columns) ^ set(t.columns))):
            raise ConfigError(f"--current tables: column(s) {', '.join(lost)} not in every repeat")
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
    returns the number of cells. Infinities are refused (a baseline must hold measurements)."""
    from tspbench.runtime.record import git_commit, utc_now, versions

    for t in tables:
        check_judged(t, tol, "current")
        for m in (m for m in MEASURED if m in t.columns):
            if t[m].abs().eq(math.inf).any():
                raise ConfigError(f"--current: column {m}: holds an infinity, not a measurement")
    current = median_table(tables, tol["exact"])
    device = current["device_name"].iloc[0] if "device_name" in current.columns else None
    meta = {
        "hardware_id": hardware_id(),
        "device_name": None if pd.isna(device) else str(device),
        "cpu_count": os.cpu_count(),
        "versions": versions(None),
        "git_commit": git_commit(),
        "created_utc": utc_now(),
        "source": [str(c) for c in sources],
        "repeats": len(tables),
        "cells": len(current),
    }
    text = json.dumps(meta, indent=2, allow_nan=False) + "\n"
    write_pair(
        baseline.with_suffix(".json"), text, baseline, current.reset_index().to_csv(index=False)
    )
    return len(current)


def write_pair(first: Path, first_text: str, second: Path, second_text: str) -> None:
    """Both files replaced, or neither: the baseline CSV and its provenance JSON must describe the
    same repeats. Both are written to temporary names, then renamed (``first`` first); if the
    second rename fails the old ``first`` is put back. One-line ConfigError on failure."""
    tmps: list[str] = []
    try:
        second.parent.mkdir(parents=True, exist_ok=True)
        for path, text in ((first, first_text), (second, second_text)):
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            tmps.append(tmp)
            mask = os.umask(0)
            os.umask(mask)
            os.fchmod(fd, 0o666 & ~mask)  # mkstemp's 0600 would hide a shared baseline
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        if first.is_file():  # a hard link keeps the old one, to put back
            tmps.append(tmps[0] + ".old")
            os.link(first, tmps[-1])
        os.replace(tmps[0], first)
        try:
            os.replace(tmps[1], second)
        except OSError:
            if len(tmps) > 2:
                os.replace(tmps[2], first)
            else:
                first.unlink()
            raise
    except OSError as e:
        raise ConfigError(f"--baseline={str(second)!r}: cannot write it ({e})") from None
    finally:
        for tmp in tmps:
            Path(tmp).unlink(missing_ok=True)
