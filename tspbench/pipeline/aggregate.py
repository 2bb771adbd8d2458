"""All run records of a sweep -> one tidy table, one row per expected cell.

Columns carry the record's key names (``strategy`` ... ``grad_norm``); ``comm_bytes`` becomes
``comm_bytes_total`` plus one ``comm_bytes_<kind>`` column per collective kind. A cell whose record
is missing or unreadable still gets a row, with status ``missing`` or ``corrupt``, so tables and
figures show it as failed instead of silently leaving it out.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from tspbench.core.comm import KINDS
from tspbench.pipeline.cells import Cell
from tspbench.runtime.record import write_atomic

SCALARS = [
    "strategy",
    "model",
    "seq_len",
    "degree",
    "tp",
    "sp",
    "dp",
    "world_size",
    "mode",
    "batch",
    "global_batch",
    "dtype",
    "status",
    "error_message",
    "peak_mem_bytes",
    "step_time_s",
    "step_time_min_s",
    "step_time_max_s",
    "tokens_per_s",
    "comm_bytes_total",
    "comm_bytes_model_group",
    "comm_bytes_dp",
    "flops_per_step",
    "mfu",
    "loss",
    "grad_norm",
    "calib_gflops",
    "tokens_per_s_per_gflops",
    "recompute",
    "overlap",
    "kv_bucket",
    "launcher",
    "git_commit",
    "timestamp_utc",
]


CELL_KEYS = ("strategy", "seq_len", "degree", "tp", "sp", "dp", "batch", "mode", "world_size")


def row(cell: Cell, path: Path) -> dict:
    spec = cell.spec
    base = {
        "cell": cell.id,
        "sweep": cell.sweep,
        "gpus": cell.gpus,
        **{k: v for k, v in spec.header("", cell.gpus).items() if k in CELL_KEYS},
        "label": spec.label,
    }
    if not path.exists():
        return {**base, "status": "missing", "error_message": f"no record at {path}"}
    try:
        rec = json.loads(path.read_text())
        if not isinstance(rec, dict) or "status" not in rec:
            raise ValueError("not a run record (no status)")
    except (ValueError, UnicodeDecodeError) as e:
        return {**base, "status": "corrupt", "error_message": f"{path}: {e}"}
    out = {**base, **{k: rec.get(k) for k in SCALARS if k in rec}}
    for kind in KINDS:
        out[f"comm_bytes_{kind}"] = (rec.get("comm_bytes") or {}).get(kind, 0.0)
    per_rank = rec.get("param_numel_per_rank") or [None]
    out["param_numel"] = per_rank[0]
    out["optimizer_numel"] = (rec.get("optimizer_numel_per_rank") or [None])[0]
    mc = rec.get("model_config") or {}
    out["hidden"], out["kv_dim"], out["ffn"] = (
        mc.get("hidden"),
        mc.get("kv_heads", 0) * mc.get("hidden", 0) // max(mc.get("heads", 1), 1),
        mc.get("ffn"),
    )
    out["device_name"] = (rec.get("hardware") or {}).get("device_name")
    return out


def aggregate(cells: list[Cell], runs_dir: Path) -> pd.DataFrame:
    rows = [row(c, runs_dir / f"{c.id}.json") for c in cells]
    return pd.DataFrame(rows)


def write_table(df: pd.DataFrame, csv: Path, parquet: Path | None = None) -> None:
    write_atomic(csv, df.to_csv(index=False))
    if parquet is not None:
        tmp = parquet.with_name(f".{parquet.name}.tmp")
        df.to_parquet(tmp, index=False)
        tmp.replace(parquet)


def write_summary(
    config: dict, runs: Path, csv: Path, parquet: Path | None, filtered_csv: Path
) -> tuple[pd.DataFrame, list[dict]]:
    """Aggregate a sweep's records into ``csv`` (and ``parquet``), its filtered combinations
    into ``filtered_csv``; returns both."""
    from tspbench.pipeline.cells import sweep_cells

    cells, filtered = sweep_cells(config)
    df = aggregate(cells, runs)
    write_table(df, csv, parquet)
    write_table(
        pd.DataFrame(filtered, columns=["cell", "reason"] if not filtered else None), filtered_csv
    )
    return df, filtered
