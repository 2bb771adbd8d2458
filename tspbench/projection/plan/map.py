"""Many plans at once: ``load_config`` reads workflows/config/plan.yaml (checked against
tspbench/schemas/plan.schema.yaml) and ``sweep`` plans every cell of sequence
length x GPUs into the table (one row per strategy: its best fitting configuration, the cell's
winner, the focus strategy's (TSP's) margin) that :mod:`.figures` draws. Everything here is
PROJECTED (analytic memory, cost model); the planner's check is in :mod:`.check`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tspbench.core.configfile import check_schema, read_yaml
from tspbench.projection import costmodel
from tspbench.projection.plan import search
from tspbench.projection.plan.cache import OpsCache, cache_dir
from tspbench.projection.plan.types import Config, Plan, Request, Row, node_size
from tspbench.runtime.registry import names, planned, schema, searched

GiB = 2**30


# -- the config -----------------------------------------------------------------------------------
def load_config(path: str | Path) -> dict[str, Any]:
    """workflows/config/plan.yaml, read without aliases and checked against
    tspbench/schemas/plan.schema.yaml (strict integers, finite numbers, bounded lists, known
    models, hardware and strategies); ConfigError names the key, the value and the rule. The
    schema's defaults fill the keys left out; the lengths and GPU counts come back sorted."""
    where = f"plan config {str(path)!r}"
    cfg = read_yaml(path, "plan config")
    check_schema(cfg, "plan.schema.yaml", where, strategies=names())
    props = schema("plan.schema.yaml")["properties"]
    out = {k: v["default"] for k, v in props.items() if "default" in v} | cfg
    out["seq_lens"], out["gpus"] = sorted(cfg["seq_lens"]), sorted(cfg["gpus"])
    out["maps"] = [dict(m) for m in cfg["maps"]]
    return out


# -- the sweep ------------------------------------------------------------------------------------
def sweep(
    cfg: dict, model: str, hardware: str, cache: str | None = None, progress: bool = False
) -> Any:
    """One plan per (S, G): per strategy its best fitting configuration (exact throughput) or
    why none fits; the cell's winner and the focus strategy's margin over the best other."""
    import pandas as pd

    ops = OpsCache(cache_dir(cache))
    rows = []
    for S in cfg["seq_lens"]:
        for G in cfg["gpus"]:
            req = Request.make(
                model, hardware, S, G, dtype=cfg["dtype"], mode=cfg["mode"],
                max_batch=cfg["max_batch"], max_degree=cfg["max_degree"],
            )  # fmt: skip
            p = search.plan(req, top=1, ops=ops)
            staged = pipeline_contest(p, cfg["focus"], ops)
            rows += [r | staged for r in cell_rows(p, cfg["focus"])]
            if progress:
                best = p.best
                print(f"S={S} G={G}: {best.config.label if best else 'nothing fits'} "
                      f"({p.timings['total_s']:.1f} s)", flush=True)  # fmt: skip
    return pd.DataFrame(rows)


def best_exact(p: Plan, keep: Callable[[Config], bool], ops: OpsCache) -> Row | None:
    """The fastest fitting configuration among those ``keep`` accepts, its operations counted:
    in the order of their bounds, until no bound left can beat the best counted."""
    best: Row | None = None
    for r in sorted((r for r in p.rows if r.fits and keep(r.config)), key=lambda r: -r.cand.speed):
        if best is not None and best.cand.speed >= r.cand.speed:
            break  # (a bound is above its counted value: none after this can win)
        if not r.cand.exact:
            search.count_config(r.config, ops, p.request.hardware)
            top = r.config.best()
            assert top is not None
            r = Row(r.config, top)
        if best is None or r.cand.speed > best.cand.speed:
            best = r
    return best


def pipeline_contest(p: Plan, focus: str, ops: OpsCache) -> dict[str, Any]:
    """Issue 34's question for one cell: the focus strategy's best plan with its model group
    inside a node and pipeline stages (``focus_pp_*``) against the best plan of any strategy
    without a pipeline axis (``no_pp_*``), with the ratio's lowest and highest over every
    corner of the preset's rate ranges (the no-pipeline plan fixed at its nominal pick); and
    against the best pipeline of any other strategy, its group inside a node likewise
    (``rival_pp_*``, ``pp_rival_ratio``: FSDP+CP in stages, say)."""
    node = node_size(p.request.hardware)
    staged = best_exact(
        p, lambda c: c.strategy == focus and c.layout.pp > 1 and c.layout.degree <= node, ops
    )
    flat = best_exact(p, lambda c: c.layout.pp == 1, ops)
    rival = best_exact(
        p, lambda c: c.strategy != focus and c.layout.pp > 1 and c.layout.degree <= node, ops
    )
    out: dict[str, Any] = {
        "focus_pp_label": None, "focus_pp_degree": None, "focus_pp_stages": None,
        "focus_pp_tokens_per_s": None, "no_pp_label": None, "no_pp_tokens_per_s": None,
        "pp_ratio": None, "pp_ratio_low": None, "pp_ratio_high": None,
        "rival_pp_label": None, "rival_pp_tokens_per_s": None, "pp_rival_ratio": None,
    }  # fmt: skip
    if rival is not None:
        out |= {"rival_pp_label": rival.config.label, "rival_pp_tokens_per_s": rival.cand.speed}
        if staged is not None:
            out["pp_rival_ratio"] = staged.cand.speed / rival.cand.speed
    if flat is not None:
        out |= {"no_pp_label": flat.config.label, "no_pp_tokens_per_s": flat.cand.speed}
    if staged is not None:
        lay = staged.config.layout
        out |= {"focus_pp_label": staged.config.label, "focus_pp_degree": lay.degree,
                "focus_pp_stages": lay.pp, "focus_pp_tokens_per_s": staged.cand.speed}  # fmt: skip
    if staged is not None and flat is not None:
        pair = [(r.cand.run, r.config.ops or 0) for r in (staged, flat)]
        ratios = [
            costmodel.project(pair[0][0], corner, pair[0][1])["tokens_per_s"]
            / costmodel.project(pair[1][0], corner, pair[1][1])["tokens_per_s"]
            for corner in costmodel.all_corners(p.request.hardware)
        ]
        out |= {"pp_ratio": staged.cand.speed / flat.cand.speed, "pp_ratio_low": min(ratios),
                "pp_ratio_high": max(ratios)}  # fmt: skip
    return out


def cell_rows(p: Plan, focus: str) -> list[dict]:
    """Per strategy of the registry: its best row of the plan (fitting, else nearest to it)."""
    req = p.request
    first: dict[str, Row] = {}
    for r in p.rows:
        first.setdefault(r.config.strategy, r)
    rules: dict[str, str] = {}
    for conf in p.configs:
        for cand in conf.candidates:
            if cand.reason:
                rules.setdefault(conf.strategy, cand.reason)
    fit = {s: r.cand.speed for s, r in first.items() if r.fits}
    other = max((v for s, v in fit.items() if s != focus), default=None)
    margin = None
    if focus in fit and other:
        margin = fit[focus] / other
    best = p.best
    out = []
    for name in planned():
        row = first.get(name)
        c = row.cand if row else None
        res = (c.result or {}) if c else {}
        out.append({
            "model": req.model, "hardware": req.hardware["name"], "seq_len": req.seq_len,
            "gpus": req.gpus, "strategy": name,
            "label": row.config.label if row else name,
            "degree": c.layout.degree if c else None, "tp": c.layout.tp if c else None,
            "sp": c.layout.sp if c else None, "dp": c.layout.dp if c else None,
            "pp": c.layout.pp if c else None,
            "pp_schedule": row.config.pipeline[1] or None if row else None,
            "microbatches": c.microbatches or None if c else None,
            "batch": c.batch if c else None, "recompute": c.recompute if c else None,
            **{k: c.options.get(k) if c else None for k in searched()},
            "fits": bool(c and c.fits),
            "peak_gib": c.peak_bytes / GiB if c else None,
            "cap_gib": req.memory_cap / GiB,
            "tokens_per_s": res.get("tokens_per_s") if c and c.fits else None,
            "tokens_per_s_per_gpu": res["tokens_per_s"] / req.gpus if c and c.fits else None,
            "mfu": res.get("mfu") if c and c.fits else None,
            "why_not": None if c and c.fits else ("memory" if c else rules.get(name, "no layout")),
            "winner": best.config.label if best else None,
            "winner_strategy": best.config.strategy if best else None,
            "focus": focus, "focus_margin": margin,
            "only_focus_fits": focus in fit and other is None,
        })  # fmt: skip
    return out
