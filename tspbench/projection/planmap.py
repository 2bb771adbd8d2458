"""Many plans at once: ``load_config`` reads workflows/config/plan.yaml (checked here: strict
integers, bounded lists, known models and hardware) and ``sweep`` plans every cell of sequence
length x GPUs into the table (one row per strategy: its best fitting configuration, the cell's
winner, the focus strategy's (TSP's) margin) that :mod:`planfigures` draws. Everything here is
PROJECTED (analytic memory, cost model); the planner's check is in :mod:`plancheck`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tspbench.core.config import PRESETS, ConfigError
from tspbench.projection import costmodel, planner
from tspbench.projection.plancache import OpsCache, cache_dir
from tspbench.projection.plantypes import Plan, Request, Row
from tspbench.runtime.registry import strategies

GiB = 2**30
KEYS = {"name", "maps", "dtype", "mode", "seq_lens", "gpus", "max_batch", "max_degree", "focus"}


# -- the config -----------------------------------------------------------------------------------
def load_config(path: str | Path) -> dict[str, Any]:
    """workflows/config/plan.yaml, checked: ConfigError names the key and the rule."""
    import yaml

    where = f"plan config {str(path)!r}"
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{where}: cannot read ({e.strerror})") from None
    if "&" in text and "*" in text:  # YAML aliases: refused as in every other config
        loader = yaml.SafeLoader(text)
        try:
            while loader.check_event():
                if isinstance(loader.get_event(), yaml.AliasEvent):
                    raise ConfigError(f"{where}: YAML aliases are not allowed")
        finally:
            loader.dispose()
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not YAML ({e.__class__.__name__})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: must be a mapping")
    extra = set(cfg) - KEYS
    if extra:
        raise ConfigError(f"{where}: {sorted(extra)[0]}: unknown key; known: {sorted(KEYS)}")

    def ints(key: str, lo: int, hi: int) -> list[int]:
        v = cfg.get(key)
        ok = isinstance(v, list) and 1 <= len(v) <= 64 and len(set(map(str, v))) == len(v)
        if not ok or any(isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi
                         for x in v):  # fmt: skip
            raise ConfigError(
                f"{where}: {key}={v!r}: must be a list of 1-64 distinct integers in {lo}..{hi}"
            )
        return sorted(v)

    out: dict[str, Any] = {
        "name": str(cfg.get("name", "plan")),
        "seq_lens": ints("seq_lens", 1, 2**24),
        "gpus": ints("gpus", 1, 65536),
        "dtype": cfg.get("dtype", "bf16"),
        "mode": cfg.get("mode", "train"),
        "max_batch": cfg.get("max_batch", 16),
        "max_degree": cfg.get("max_degree"),
        "focus": cfg.get("focus", next(iter(strategies()))),
    }
    for key, choices in (("dtype", ("bf16", "fp32")), ("mode", ("train", "infer")),
                         ("focus", tuple(strategies()))):  # fmt: skip
        if out[key] not in choices:
            raise ConfigError(f"{where}: {key}={out[key]!r}: must be one of {', '.join(choices)}")
    for key, lo, hi, none in (("max_batch", 1, 4096, False), ("max_degree", 1, 65536, True)):
        v = out[key]
        if not (none and v is None) and (
            isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi
        ):
            raise ConfigError(f"{where}: {key}={v!r}: must be an integer in {lo}..{hi}")
    maps = cfg.get("maps")
    if not isinstance(maps, list) or not 1 <= len(maps) <= 16:
        raise ConfigError(f"{where}: maps: must be a list of 1-16 {{model, hardware}} entries")
    for i, m in enumerate(maps):
        if not isinstance(m, dict) or set(m) != {"model", "hardware"}:
            raise ConfigError(f"{where}: maps.{i}: must be {{model: ..., hardware: ...}}")
        if m["model"] not in PRESETS:
            raise ConfigError(f"{where}: maps.{i}.model={m['model']!r}: not a model preset")
        if m["hardware"] not in costmodel.presets():
            raise ConfigError(
                f"{where}: maps.{i}.hardware={m['hardware']!r}: must be one of "
                f"{', '.join(costmodel.presets())}"
            )
    out["maps"] = [dict(m) for m in maps]
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
            p = planner.plan(req, top=1, ops=ops)
            rows += cell_rows(p, cfg["focus"])
            if progress:
                best = p.best
                print(f"S={S} G={G}: {best.config.label if best else 'nothing fits'} "
                      f"({p.timings['total_s']:.1f} s)", flush=True)  # fmt: skip
    return pd.DataFrame(rows)


def cell_rows(p: Plan, focus: str) -> list[dict]:
    """Per strategy of the registry: its best row of the plan (fitting, else nearest to it)."""
    req = p.request
    first: dict[str, Row] = {}
    for r in p.rows:
        first.setdefault(r.config.strategy, r)
    rules: dict[str, str] = {}
    for conf in p.configs:
        for c in conf.candidates:
            if c.reason:
                rules.setdefault(conf.strategy, c.reason)
    fit = {s: r.cand.tokens_per_s for s, r in first.items() if r.fits}
    other = max((v for s, v in fit.items() if s != focus), default=None)
    margin = None
    if focus in fit and other:
        margin = fit[focus] / other
    best = p.best
    out = []
    for name in strategies():
        r = first.get(name)
        c = r.cand if r else None
        res = (c.result or {}) if c else {}
        out.append({
            "model": req.model, "hardware": req.hardware["name"], "seq_len": req.seq_len,
            "gpus": req.gpus, "strategy": name,
            "label": r.config.label if r else name,
            "degree": c.layout.degree if c else None, "tp": c.layout.tp if c else None,
            "sp": c.layout.sp if c else None, "dp": c.layout.dp if c else None,
            "batch": c.batch if c else None, "recompute": c.recompute if c else None,
            "mlp_schedule": c.mlp_schedule if c else None,
            "kv_bucket": c.kv_bucket if c else None, "fits": bool(c and c.fits),
            "peak_gib": c.peak / GiB if c else None,
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
