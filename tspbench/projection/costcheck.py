"""``tspbench project-check``: the cost model's step time against measured summaries, cell by
cell, read against the machine's own run-to-run spread (out of :mod:`costmodel`, which projects;
this judges it)."""

from __future__ import annotations

import dataclasses
import statistics

from tspbench.core.config import ConfigError, ModelConfig, read_csv_input, require_dense
from tspbench.projection.costmodel import case_of_row, project
from tspbench.runtime.pipelined import check_projected
from tspbench.runtime.registry import strategies
from tspbench.runtime.spec import RunSpec


def measured_runs(paths: list[str]) -> tuple[list, list[str]]:
    """The ok training and forward cells of each summary (indexed by cell; decode cells are
    projected by projection/decode.py; cells of a model with experts are left out: their
    projection assumes even routing, where a measured run routes by data), and the cells every
    summary has."""
    runs = []
    for path in paths:
        df = read_csv_input(path, "--summary")
        if "mode" in df.columns:
            df = df[~df["mode"].isin(["decode", "generate"])]
        if "experts" in df.columns:
            df = df[df["experts"].fillna(0) == 0]
        runs.append(df[df["status"] == "ok"].drop_duplicates("cell").set_index("cell"))
    return runs, [c for c in runs[0].index if all(c in r.index for r in runs[1:])]


def check_summary(paths: list[str], preset: dict):
    """Predicted against measured step time for every cell that succeeded in every summary CSV.

    Several summaries are repeated runs of one sweep: the measured time is their median, and
    the runs' range is kept so that each error can be read against the machine's own
    run-to-run spread.
    """
    import pandas as pd

    runs, cells = measured_runs(paths)
    rows = []
    for cell in cells:
        row = runs[0].loc[cell].to_dict()
        times = [float(r.loc[cell, "step_time_s"]) for r in runs]
        rows.append(_row(case_of_row(row), row.get("label", ""), times, preset))
    return pd.DataFrame(rows)


def check_records(paths: list[str], preset: dict):
    """Predicted against measured step time for each ok training or forward record (its own
    model, layout and options: a record of 4 layers is projected at 4 layers). One record is one
    run: no range. Records are checked against their schema first (ConfigError naming one).
    A zero-bubble schedule's record is refused, naming it: the model does not price one
    (:func:`tspbench.runtime.pipelined.check_projected`)."""
    import pandas as pd

    from tspbench.runtime.record import check_record

    rows = []
    for path in paths:
        rec = check_record(path)
        if rec["status"] != "ok" or rec["mode"] not in ("train", "infer"):
            continue
        impl = strategies()[rec["strategy"]]
        pipeline = {}  # a pipelined record's stages, schedule and micro-batches
        if rec.get("pp", 1) > 1:
            check_projected(rec["pp_schedule"], f"record {path!r}: pp_schedule")
            pipeline = {"pp": rec["pp"], "pp_schedule": rec["pp_schedule"],
                        "microbatches": rec["microbatches"]}  # fmt: skip
        options = {o.name: rec[o.name] for o in impl.options if rec.get(o.name) is not None}
        c = RunSpec.make(
            rec["strategy"], _model(rec, path), degree=rec["degree"],
            tp=rec.get("tp") or 1, sp=rec.get("sp") or 1, dp=rec["dp"], seq_len=rec["seq_len"],
            batch=rec["batch"], mode=rec["mode"], dtype=rec["dtype"],
            recompute=_field(rec, path, "recompute"), **pipeline, **options,
        )  # fmt: skip
        rows.append(_row(c, c.label, [rec["step_time_s"]], preset))
    return pd.DataFrame(rows)


def _field(rec: dict, path: str, key: str):
    """A key a projection needs that the record schema does not require (one line if absent)."""
    if key not in rec:
        raise ConfigError(f"record {path!r}: {key}: missing; a run record states it")
    return rec[key]


# model fields that records written before them lack: their defaults are what those runs ran
LATER_FIELDS = {
    "rope_scaling": "", "qk_norm": False, "qkv_bias": False, "tie_embeddings": False,
    "head_dim": 0, "o_bias": False, "mlp_bias": False, "experts": 0, "top_k": 0,
    "expert_ffn": 0, "norm_topk": True, "shared_ffn": 0, "aux_loss": 0.0,
}  # fmt: skip


def _model(rec: dict, path: str) -> ModelConfig:
    """The record's model, from its ``model_config``, which must name every field: a field left
    out would be projected at a toy default (ConfigError naming the record otherwise)."""
    mc, need = _field(rec, path, "model_config"), {f.name for f in dataclasses.fields(ModelConfig)}
    if isinstance(mc, dict):  # a field added later: its default is the model older runs ran
        mc = {**{k: v for k, v in LATER_FIELDS.items() if k not in mc}, **mc}
    if not isinstance(mc, dict) or set(mc) != need:
        got = sorted(mc) if isinstance(mc, dict) else type(mc).__name__
        raise ConfigError(
            f"record {path!r}: model_config: must hold exactly the fields {sorted(need)} to be "
            f"projected (got {got})"
        )
    try:
        cfg = ModelConfig(**mc)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"record {path!r}: model_config: {e}") from None
    require_dense(cfg, f"tspbench project-check (record {path!r})",
                  "a run routes by data; its projection assumes even routing")  # fmt: skip
    return cfg


def _row(c: RunSpec, label: str, times: list[float], preset: dict) -> dict:
    """One cell of the check: the measured runs' median and range against the projection."""
    times = sorted(times)
    measured, p = statistics.median(times), project(c, preset)
    return {
        "strategy": c.strategy,
        "label": label,
        "seq_len": c.seq_len,
        "degree": c.degree,
        "dp": c.dp,
        "batch": c.batch,
        "mode": c.mode,
        "runs": len(times),
        "measured_s": measured,
        "measured_min_s": times[0],
        "measured_max_s": times[-1],
        "spread": times[-1] / times[0] - 1,
        "projected_s": p["step_time_s"],
        "error": p["step_time_s"] / measured - 1,
        "inside_range": len(times) > 1 and times[0] <= p["step_time_s"] <= times[-1],
        "compute_s": p["compute_s"],
        "dispatch_s": p["dispatch_s"],
        "comm_s": p["comm_critical_s"] + p["comm_overlappable_s"] - p["comm_hidden_s"],
    }


def check_footer(table) -> str:
    """One paragraph: how many cells are within 25%, against the run-to-run spread."""
    errs = table["error"].abs()
    n = len(table)
    text = (
        f"{n} cells; |error| median {errs.median():.1%}, max {errs.max():.1%}; "
        f"within 25%: {(errs <= 0.25).sum()}/{n}"
    )
    if n and table["runs"].min() > 1:
        spread = table["spread"]
        text += (
            f". Measured = median of {table['runs'].min()} runs; run-to-run spread (max/min - 1) "
            f"median {spread.median():.1%}, max {spread.max():.1%}; projection inside the "
            f"measured range: {table['inside_range'].sum()}/{n}; within 25% or inside the "
            f"range: {((errs <= 0.25) | table['inside_range']).sum()}/{n}"
        )
    return text + "\n"
