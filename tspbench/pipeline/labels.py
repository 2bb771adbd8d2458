"""How tables and figures name and order things, from the aggregate table alone: strategies in
the registry's order (TSP first), the memory unit, what a rank ran on (GPU or CPU rank, from the
records, never a constant) and the hardware's name, the mark of a cell without a number (OOM,
failed), and pivots of one value (strategy x swept value)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pandas as pd

from tspbench.runtime.registry import reference_name, strategies

MARK = {"oom": "OOM", "error": "failed", "missing": "failed", "corrupt": "failed"}
TIE = 0.005  # peaks within 0.5% of each other are a tie (claims): estimates are not that exact


def tied(a: float, b: float) -> bool:
    """Whether two peaks are a tie: within :data:`TIE` of the larger."""
    return abs(a - b) <= TIE * max(abs(a), abs(b))


ORDER = list(strategies())  # the registry's order: TSP first
# the single-device reference (one rank, whole model): what decode caches are set against
REFERENCE = reference_name()
# device names torch reports for GPUs (CUDA and ROCm); a CPU run's name is the CPU model's
GPU_NAME = re.compile(r"NVIDIA|Tesla|GeForce|Quadro|Instinct|Radeon|\bMI\d{3}|\bGPU\b", re.I)


def is_reference(names: pd.Series) -> pd.Series:
    """Which rows are the single-device reference's: each strategy says whether it is."""
    return names.map(lambda n: getattr(strategies().get(n), "reference", False)).astype(bool)


def display(label: object) -> str:
    """A label as a reader spells it: the strategy's own display name with the label's variant
    (``tpsp (2x4)`` -> ``TP+SP (2x4)``, ``fsdp_cp`` -> ``FSDP+CP``); anything else as it is."""
    name, _, rest = str(label).partition(" ")
    impl = strategies().get(name)
    if impl is None:
        return str(label)
    return getattr(impl, "display", name) + (f" {rest}" if rest else "")


def label_order(labels) -> list[str]:
    """Strategy labels in the registry's order (TSP first), factorisations in numeric order
    within a strategy (``tpsp 2x4`` before ``tpsp 4x2``); unknown labels last."""

    def key(label: str) -> tuple:
        name = label.split(" ")[0]
        rank = ORDER.index(name) if name in ORDER else len(ORDER)
        return (rank, [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", label)])

    return sorted({str(x) for x in labels}, key=key)


def mem_unit(df: pd.DataFrame) -> tuple[str, float]:
    peak = df["peak_mem_bytes"].max() if "peak_mem_bytes" in df else 0
    return ("GiB", 2**30) if peak and peak > 10 * 2**30 else ("MiB", 2**20)


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"] if "status" in df else df


def device(df: pd.DataFrame) -> tuple[str, str]:
    """(one, many) of what a rank ran on, from the records: ``("GPU", "GPUs")``,
    ``("CPU rank", "CPU ranks")``, or ``("rank", "ranks")`` when the records do not say or
    disagree (``device_type`` where the summary has it, else the device's name)."""
    ok = _ok(df)
    kinds = set(ok["device_type"].dropna().astype(str)) if "device_type" in ok else set()
    if not kinds and "device_name" in ok:
        names = ok["device_name"].dropna().astype(str)
        kinds = {"cuda" if GPU_NAME.search(n) else "cpu" for n in names}
    if kinds == {"cuda"}:
        return "GPU", "GPUs"
    if kinds == {"cpu"}:
        return "CPU rank", "CPU ranks"
    return "rank", "ranks"


def hardware(df: pd.DataFrame) -> str:
    """What the records say they ran on, e.g. ``AMD EPYC, 2 CPUs (CPU ranks)`` or
    ``NVIDIA H100 80GB HBM3 (GPUs)``; ``unknown hardware ...`` when none says."""
    ok = _ok(df)
    names = sorted(set(ok["device_name"].dropna().astype(str))) if "device_name" in ok else []
    if not names:
        return "unknown hardware (no record names it)"
    one, many = device(df)
    cores = ""
    if one == "CPU rank" and "cpu_count" in ok and ok["cpu_count"].notna().any():
        n = sorted({int(c) for c in ok["cpu_count"].dropna()})
        cores = f", {'/'.join(map(str, n))} CPU{'s' if n != [1] else ''}"
    return f"{', '.join(names)}{cores} ({many})"


def _cell(row: pd.Series, value: str, fmt: str) -> str:
    if row["status"] != "ok":
        return MARK.get(row["status"], "failed")
    return fmt.format(row[value])


def pivot(df: pd.DataFrame, index: str, column: str, value: str, fmt: str) -> pd.DataFrame:
    """Rows ``index`` (strategy labels, in :func:`label_order`), columns ``column`` (sorted),
    each entry the formatted value or why there is none; ``-`` where the sweep has no cell."""
    shown = df.assign(shown=[_cell(r, value, fmt) for _, r in df.iterrows()])
    table = shown.pivot_table(index=index, columns=column, values="shown", aggfunc="first")
    table = table.reindex(label_order(table.index))
    table.columns = [str(c) for c in table.columns]
    table.index.name = "strategy" if index == "label" else index
    return table.fillna("-")


def groups(df: pd.DataFrame, key: str, tag: str) -> Iterator[tuple[str, object, pd.DataFrame]]:
    """(name suffix, value, rows) per value of ``key``; the suffix (``_D4``) only when there
    are several values, so one table per value and names stay short in the usual case."""
    values = sorted(df[key].dropna().unique())
    for v in values:
        yield (f"_{tag}{v}" if len(values) > 1 else ""), v, df[df[key] == v]
