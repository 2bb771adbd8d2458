"""All run records of a sweep -> one tidy table, one row per expected cell.

Columns carry the record's key names (``strategy`` ... ``grad_norm``); ``comm_bytes`` becomes
``comm_bytes_total`` plus one ``comm_bytes_<kind>`` column per collective kind, and
``peak_parts_bytes`` one ``peak_<part>_bytes`` column per part of the peak. A cell whose record
is missing or unreadable still gets a row, with status ``missing`` or ``corrupt``, so tables and
figures show it as failed instead of silently leaving it out.

Decode cells (modes ``decode``, ``generate``) add ``new_tokens`` and the decode measurements
(``DECODE``): ``prefill_time_s``, ``decode_latency_s`` ... ``decode_bytes_per_token``, and
``generated_tokens`` as JSON text (``[[id, ...], ...]``, one list per sequence) so that runs can
be compared; other cells leave them empty.

``sweep`` names every sweep that lists the cell, joined by ``;`` (``seq;degree``): a cell runs
once and has one row, and :func:`per_sweep` gives it one row in each of its sweeps for the tables
and figures.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from tspbench.core.comm import KINDS
from tspbench.core.config import ConfigError
from tspbench.pipeline.cells import Cell
from tspbench.runtime.measure import PARTS, part_column
from tspbench.runtime.record import write_atomic
from tspbench.runtime.registry import all_options, names, option_schemas
from tspbench.runtime.spec import DECODE_MODES

# The table's record columns, in its order (its own, not the record's): record keys all
# (tspbench.runtime.record_keys; tests/unit/test_record_keys.py checks them)
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
    "peak_mem_bytes_first_step",
    "step_time_s",
    "step_time_min_s",
    "step_time_max_s",
    "tokens_per_s",
    "comm_bytes_total",
    "comm_bytes_model_group",
    "comm_bytes_dp",
    "flops_per_step",
    "flops_executed_per_step",
    "mfu",
    "loss",
    "grad_norm",
    "calib_gflops",
    "tokens_per_s_per_gflops",
    "startup_s",
    "wall_s",
    "recompute",
    *all_options(),  # every strategy's options (the record's: unused ones at their default)
    "launcher",
    "attention_backend",
    "git_commit",
    "timestamp_utc",
]
EXPERTS = ["expert_load_imbalance"]  # a model with experts: the busiest expert's rows / mean
DECODE = [  # decode, generate (docs/decode.md); the record's schema says what each one is
    "new_tokens",
    "prefill_time_s",
    "decode_latency_s",
    "decode_latency_p90_s",
    "decode_tokens_per_s",
    "generate_time_s",
    "kv_cache_bytes",
    "decode_bytes_per_token",
    "prefill_comm_bytes",
]


CELL_KEYS = (
    *("strategy", "seq_len", "degree", "tp", "sp", "dp", "batch", "mode", "new_tokens"),
    "world_size",
    *("pp", "pp_schedule", "microbatches"),  # a pipelined cell's (record_keys.PIPELINE)
)
# a record must have been run with its cell's inputs: one copied or left over from another cell
# would put that cell's numbers in this row
MATCH_KEYS = (*CELL_KEYS, "dtype", "model")
SWEEP_SEP = ";"  # sweep names are [A-Za-z0-9_-]+ (the config schema): never in a name
MAX_RECORD_BYTES = 64 * 2**20  # a record is a few kB; anything near this is not one


def read_record(cell: Cell, path: Path) -> tuple[dict | None, str]:
    """(record, "") when ``path`` holds a valid record of ``cell``, else (None, why): one bad file
    becomes one ``corrupt`` row instead of stopping the aggregate or filling another cell's row."""
    from tspbench.pipeline.cells import check_schema, non_finite

    try:
        if not path.is_file():
            return None, f"{path}: not a regular file"
        if path.stat().st_size > MAX_RECORD_BYTES:
            return None, f"{path}: {path.stat().st_size} bytes, not a run record"
        rec = json.loads(path.read_text())
        check_schema(rec, "record.schema.json", str(path), False, names(), option_schemas())
    except (OSError, ValueError, RecursionError) as e:  # ConfigError and JSON errors included
        return None, str(e) if isinstance(e, ConfigError) else f"{path}: {type(e).__name__}: {e}"
    expected = cell.spec.header("", cell.gpus)
    for key in (k for k in MATCH_KEYS if rec.get(k) != expected.get(k)):
        return (
            None,
            f"{path}: record of {key}={rec.get(key)!r}, cell {cell.id} has {expected.get(key)!r}",
        )
    bad = non_finite(rec)
    if bad and rec["status"] != "error":
        return None, f"{path}: {bad[0]}: {bad[1]!r} is not a finite number"
    return rec, ""


def row(cell: Cell, path: Path) -> dict:
    """The cell's row: its inputs, then the record's values (status missing/corrupt if none)."""
    spec = cell.spec
    base = {
        "cell": cell.id,
        "sweep": SWEEP_SEP.join(cell.sweeps),
        "gpus": cell.gpus,
        **{k: v for k, v in spec.header("", cell.gpus).items() if k in CELL_KEYS},
        "label": spec.label,
        "experts": spec.cfg.experts,  # 0: dense
        **({"top_k": spec.cfg.top_k, "expert_ffn": spec.cfg.moe_ffn} if spec.cfg.moe else {}),
    }
    if not path.exists() and not path.is_symlink():
        return {**base, "status": "missing", "error_message": f"no record at {path}"}
    rec, why = read_record(cell, path)
    if rec is None:
        return {**base, "status": "corrupt", "error_message": why}
    out = {**base, **{k: rec.get(k) for k in (*SCALARS, *EXPERTS, *DECODE) if k in rec}}
    if rec.get("tokens_per_expert") is not None:
        out["tokens_per_expert"] = json.dumps(rec["tokens_per_expert"], separators=(",", ":"))
    if rec.get("generated_tokens") is not None:
        out["generated_tokens"] = json.dumps(rec["generated_tokens"], separators=(",", ":"))
    for kind in KINDS:
        out[f"comm_bytes_{kind}"] = (rec.get("comm_bytes") or {}).get(kind, 0.0)
    for part in PARTS:  # what was live at the peak (empty where the record has no split)
        out[part_column(part)] = (rec.get("peak_parts_bytes") or {}).get(part)
    per_rank = rec.get("param_numel_per_rank") or [None]
    out["param_numel"] = per_rank[0]
    out["optimizer_numel"] = (rec.get("optimizer_numel_per_rank") or [None])[0]
    mc = rec.get("model_config") or {}
    heads = max(mc.get("heads", 1), 1)
    d = mc.get("head_dim") or mc.get("hidden", 0) // heads  # head_dim 0 (or absent): h/heads
    out["hidden"], out["kv_dim"], out["ffn"] = (
        mc.get("hidden"),
        mc.get("kv_heads", 0) * d,
        mc.get("ffn"),
    )
    out["heads"], out["q_dim"] = mc.get("heads"), heads * d  # Q's width (h unless head_dim)
    hw = rec.get("hardware") or {}
    out["device_name"], out["device_type"] = hw.get("device_name"), hw.get("device_type")
    out["cpu_count"] = hw.get("cpu_count")  # logical CPUs of the host (what CPU ranks share)
    return out


# What a sweep varies decides its tables and figures, never its name: the first axis with two
# values or more, in this order (a degree sweep may list two lengths; nothing varied: by length)
ROLE_AXES = (("degree", "degree"), ("gpus", "scaling"), ("batch", "batch"), ("seq_len", "seq"))


def role(rows: pd.DataFrame) -> str:
    """A sweep's role from its training and forward rows: ``moe`` where its model has experts
    (a table and a claims row of its own; the dense figures never mix it in), ``pipeline`` where
    some cell has stages (the claims table reads it; no figure draws it), else ``degree``,
    ``scaling``, ``batch`` or ``seq`` (decode cells have tables of their own)."""
    if "experts" in rows and (rows["experts"].fillna(0) > 0).any():
        return "moe"
    if "pp" in rows and (rows["pp"].fillna(1) > 1).any():
        return "pipeline"
    for axis, name in ROLE_AXES:
        if axis in rows and rows[axis].nunique() > 1:
            return name
    return "seq"


def per_sweep(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (cell, sweep): a cell listed by several sweeps (``sweep`` = ``seq;degree``)
    appears in each, with ``sweep`` its one name there, and ``role`` what that sweep varies
    (:func:`role`; ``decode`` for decode cells). Tables and figures select by role."""
    if "sweep" not in df or df.empty:
        return df
    names = df["sweep"].astype(str).str.split(SWEEP_SEP)
    out = df.assign(sweep=names).explode("sweep", ignore_index=True)
    decode = out["mode"].isin(DECODE_MODES)
    roles = {n: role(g) for n, g in out[~decode].groupby("sweep")}
    return out.assign(role=out["sweep"].map(roles).where(~decode, "decode"))


def aggregate(cells: list[Cell], runs_dir: Path) -> pd.DataFrame:
    rows = [row(c, runs_dir / f"{c.id}.json") for c in cells]
    return pd.DataFrame(rows)


def write_table(df: pd.DataFrame, csv: Path, parquet: Path | None = None) -> None:
    """The table as CSV and Parquet, each complete or not there: a failed Parquet write leaves
    neither a partial file nor its temporary behind (one-line ConfigError: exit 2)."""
    write_atomic(csv, df.to_csv(index=False))
    if parquet is None:
        return
    tmp = parquet.with_name(f".{parquet.name}.tmp")
    try:
        df.to_parquet(tmp, index=False)
        tmp.replace(parquet)
    except (OSError, ValueError, TypeError) as e:  # pyarrow's errors are ValueError/TypeError
        raise ConfigError(f"--parquet={str(parquet)!r}: cannot write it ({e})") from None
    finally:
        tmp.unlink(missing_ok=True)


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


def report(df: pd.DataFrame, filtered: list[dict]) -> str:
    """What ``tspbench aggregate`` prints: cells by status, filtered combinations, and each
    cell without a result with its reason."""
    counts = ", ".join(f"{n} {s}" for s, n in df["status"].value_counts().items())
    lines = [f"{len(df)} cells ({counts}); {len(filtered)} combinations filtered"]
    lines += [f"  {r['cell']}: {r['status']}: {r.get('error_message')}"
              for _, r in df[df["status"] != "ok"].iterrows()]  # fmt: skip
    return "\n".join(lines)
