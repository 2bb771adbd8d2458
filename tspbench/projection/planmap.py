"""Many plans at once: the map of which layout wins over sequence length x GPUs, where each
strategy fits, the focus strategy's (TSP's) margin, and the planner's check against measured
and estimated cells. Everything drawn here is PROJECTED (analytic memory, cost model).

``load_config`` reads workflows/config/plan.yaml (checked here: strict integers, bounded lists,
known models and hardware), ``sweep`` plans every cell, ``write_map`` writes ``map.csv`` and the
figures (PNG and PDF), ``check`` writes the validation the docs quote (docs/planning.md).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

from tspbench.core.config import PRESETS, ConfigError, load_model
from tspbench.projection import analytic, costmodel, planner
from tspbench.runtime.registry import strategies
from tspbench.runtime.spec import RunSpec

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

    ops = planner.OpsCache(planner.cache_dir(cache))
    rows = []
    for S in cfg["seq_lens"]:
        for G in cfg["gpus"]:
            req = planner.Request.make(
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


def cell_rows(p: planner.Plan, focus: str) -> list[dict]:
    """Per strategy of the registry: its best row of the plan (fitting, else nearest to it)."""
    req = p.request
    first: dict[str, planner.Row] = {}
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


def flat_in_gpus(table) -> bool:
    """Whether every sequence length has one winner (label, D, B, recompute) at every GPU count."""
    wins = table[table.strategy == table.winner_strategy]
    keys = wins[["seq_len", "label", "degree", "batch", "recompute"]].astype(str)
    return bool(len(wins)) and keys.drop_duplicates().seq_len.is_unique


# -- the figures ----------------------------------------------------------------------------------
def _short(n: int) -> str:
    return f"{n // 2**20}M" if n >= 2**20 and n % 2**20 == 0 else f"{n // 1024}K"


def _grid(ax, seq_lens, gpus, title: str) -> None:
    ax.set_xticks(range(len(seq_lens)), [_short(s) for s in seq_lens])
    ax.set_yticks(range(len(gpus)), [str(g) for g in gpus])
    ax.set_xlabel("sequence length S")
    ax.set_ylabel("GPUs")
    ax.set_title(title, fontsize=10)
    ax.set_xticks([x - 0.5 for x in range(1, len(seq_lens))], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, len(gpus))], minor=True)
    ax.grid(which="minor", color="white", lw=1.5)
    ax.grid(which="major", visible=False)
    ax.tick_params(which="minor", length=0)


def _save(fig, out: Path, name: str) -> None:
    import matplotlib.pyplot as plt

    for ext in ("png", "pdf"):
        path = out / f"{name}.{ext}"
        tmp = out / f".{name}.tmp.{ext}"
        meta = {"CreationDate": None} if ext == "pdf" else {"Software": None}
        fig.savefig(tmp, dpi=150, bbox_inches="tight", metadata=meta)
        tmp.replace(path)
    plt.close(fig)


def write_map(table, cfg: dict, model: str, hardware: str, out: str | Path) -> None:
    """``map.csv`` and three figures (PNG and PDF): the winner per cell, each strategy's
    feasible region with its projected tokens/s per GPU, and the focus strategy's margin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import seaborn as sns
    from matplotlib.colors import BoundaryNorm, ListedColormap, LogNorm, TwoSlopeNorm
    from matplotlib.patches import Patch

    from tspbench.runtime.record import write_atomic

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "map.csv", table.to_csv(index=False, float_format="%.6g"))
    sns.set_theme(style="white", context="paper")
    S, G = cfg["seq_lens"], cfg["gpus"]
    names = list(strategies())
    colors = dict(zip(names, sns.color_palette("deep", len(names))))
    cap = table["cap_gib"].iloc[0]
    what = f"{model} {cfg['mode']} {cfg['dtype']} on {hardware} ({cap:.0f} GiB per GPU)"
    cells = table.drop_duplicates(["seq_len", "gpus"]).set_index(["seq_len", "gpus"])

    # 1. the winner of every cell
    fig, ax = plt.subplots(figsize=(1.25 * len(S) + 2.2, 0.62 * len(G) + 1.6))
    idx = np.full((len(G), len(S)), np.nan)
    for i, g in enumerate(G):
        for j, s in enumerate(S):
            row = cells.loc[(s, g)]
            if row["winner_strategy"] is None or row["winner_strategy"] != row["winner_strategy"]:
                ax.text(j, i, "nothing\nfits", ha="center", va="center", fontsize=7, color="0.35")
                continue
            idx[i, j] = names.index(row["winner_strategy"])
            win = table[(table.seq_len == s) & (table.gpus == g)
                        & (table.strategy == row["winner_strategy"])].iloc[0]  # fmt: skip
            text = (f"{win['label']}\nD{int(win['degree'])} B{int(win['batch'])}"
                    f"{' rc' if win['recompute'] == 'full' else ''}")  # fmt: skip
            ax.text(j, i, text, ha="center", va="center", fontsize=6.5)
    cmap = ListedColormap([colors[n] for n in names]).with_extremes(bad="0.92")
    ax.imshow(idx, cmap=cmap, norm=BoundaryNorm(np.arange(len(names) + 1) - 0.5, len(names)),
              origin="lower", aspect="auto", alpha=0.75)  # fmt: skip
    _grid(ax, S, G, f"PROJECTED best layout (most tokens/s that fits), {what}")
    used = [n for n in names if n in set(table["winner_strategy"].dropna())]
    ax.legend(handles=[Patch(color=colors[n], alpha=0.75, label=n) for n in used],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)  # fmt: skip
    note = (f"rc: recompute full. D: model group, B: micro-batch (1..{cfg['max_batch']} tried); "
            "D <= GPUs per node. Memory: analytic; throughput: cost model.")  # fmt: skip
    if flat_in_gpus(table):
        note += (
            "\nThe winner is the same at every GPU count: with micro-batches free, more GPUs add "
            "data-parallel replicas, whose all-reduce the cost model hides."
        )
    fig.text(0.01, -0.02, note, fontsize=7)
    _save(fig, out, "winner")

    # 2. feasible region per strategy, coloured by its best tokens/s per GPU
    n = len(names)
    cols = min(4, n)
    rows_n = math.ceil(n / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.1 * cols, 2.4 * rows_n + 0.6),
                             sharex=True, sharey=True, squeeze=False)  # fmt: skip
    per_gpu = table["tokens_per_s_per_gpu"].dropna()
    norm = LogNorm(per_gpu.min(), per_gpu.max()) if len(per_gpu) else None
    for k, name in enumerate(names):
        ax = axes[k // cols][k % cols]
        d = table[table.strategy == name].set_index(["seq_len", "gpus"])
        grid = np.full((len(G), len(S)), np.nan)
        for i, g in enumerate(G):
            for j, s in enumerate(S):
                r = d.loc[(s, g)]
                if r["fits"]:
                    grid[i, j] = r["tokens_per_s_per_gpu"]
                else:
                    ax.text(j, i, "x", ha="center", va="center", fontsize=7, color="0.45")
        cm = plt.get_cmap("viridis").with_extremes(bad="0.93")
        im = ax.imshow(grid, cmap=cm, norm=norm, origin="lower", aspect="auto")
        _grid(ax, S, G, name)
        ax.tick_params(labelsize=6.5)
        ax.tick_params(axis="x", labelrotation=60)
        if k % cols:
            ax.set_ylabel("")
        if k // cols != rows_n - 1:
            ax.set_xlabel("")
    for k in range(n, rows_n * cols):
        axes[k // cols][k % cols].axis("off")
    if norm is not None:
        fig.colorbar(im, ax=axes, shrink=0.8, label="projected tokens/s per GPU (best that fits)")
    fig.suptitle(f"PROJECTED memory-feasible region per strategy, {what}; x: nothing fits",
                 fontsize=10)  # fmt: skip
    _save(fig, out, "feasible")

    # 3. the focus strategy's margin over the best other strategy
    focus = cfg["focus"]
    fig, ax = plt.subplots(figsize=(1.25 * len(S) + 2.2, 0.62 * len(G) + 1.6))
    vals = [m for m in cells["focus_margin"] if m is not None and m == m]
    span = max([abs(math.log(m)) for m in vals] + [0.05])
    grid = np.full((len(G), len(S)), np.nan)
    for i, g in enumerate(G):
        for j, s in enumerate(S):
            row = cells.loc[(s, g)]
            m = row["focus_margin"]
            focus_fits = bool(table[(table.seq_len == s) & (table.gpus == g)
                                    & (table.strategy == focus)]["fits"].iloc[0])  # fmt: skip
            if m == m and m is not None:
                grid[i, j] = m
                dark = abs(math.log(m)) > 0.6 * span
                pct = (m - 1) * 100
                ax.text(j, i, f"{pct:+.{1 if abs(pct) >= 0.1 else 2}f}%", ha="center",
                        va="center", fontsize=7,
                        color="white" if dark else "black")  # fmt: skip
            elif row["only_focus_fits"]:
                ax.text(j, i, f"only\n{focus}", ha="center", va="center", fontsize=7,
                        weight="bold")  # fmt: skip
            elif (
                not focus_fits
                and row["winner_strategy"] == row["winner_strategy"]
                and row["winner_strategy"]
            ):
                ax.text(j, i, f"{focus}\nOOM", ha="center", va="center", fontsize=7, color="0.3")
            else:
                ax.text(j, i, "nothing\nfits", ha="center", va="center", fontsize=7, color="0.35")
    cm = plt.get_cmap("RdBu").with_extremes(bad="0.92")
    im = ax.imshow(grid, cmap=cm, origin="lower", aspect="auto",
                   norm=TwoSlopeNorm(1.0, math.exp(-span), math.exp(span)))  # fmt: skip
    _grid(ax, S, G, f"PROJECTED {focus} margin over the best other strategy, {what}")
    fig.colorbar(
        im, ax=ax, shrink=0.85, label=f"{focus} tokens/s / best other's (>1: {focus} wins)"
    )
    fig.text(0.01, -0.02, f"cell: {focus}'s projected tokens/s against the best other strategy's "
             f"(+: {focus} faster); only {focus}: no other strategy fits; {focus} OOM: {focus} "
             "does not fit; grey: no strategy fits.", fontsize=7)  # fmt: skip
    _save(fig, out, "margin")


# -- the check ------------------------------------------------------------------------------------
def _norm(label: object) -> str:
    """A strategy label as any table spells it: ``tpsp (2x4)``, ``tpsp 2x4`` -> ``tpsp2x4``."""
    return re.sub(r"[^a-z0-9_]", "", str(label).lower())


def spearman(a, b) -> float:
    """Spearman's rank correlation: Pearson's of average ranks (pandas; no scipy needed)."""
    import pandas as pd

    ra, rb = pd.Series(list(a)).rank(), pd.Series(list(b)).rank()
    return float(ra.corr(rb))


def check(
    summaries: list[str],
    hardware: str,
    memory_csv: str,
    memory_hardware: str = "mi300x",
    cache: str | None = None,
) -> str:
    """The planner against what was measured and estimated (docs/planning.md quotes it):
    1. measured cells: does the analytic peak rank them as the measured peak does (Spearman)?
    2. per question (S, GPUs, mode, global batch): is the planner's pick within the measured
       run-to-run range of the measured best?
    3. projected 7B cells: does the analytic model agree with the estimator on what fits?"""
    import pandas as pd

    for p in [*summaries, memory_csv]:
        if not Path(p).is_file():
            raise ConfigError(f"{p}: no such file")
    preset = costmodel.load_preset(hardware)
    runs = []
    for path in summaries:
        df = pd.read_csv(path)
        runs.append(df[df["status"] == "ok"].drop_duplicates("cell").set_index("cell"))
    cells = [c for c in runs[0].index if all(c in r.index for r in runs[1:])]
    ops = planner.OpsCache(planner.cache_dir(cache))
    lines = ["# The planner against measured and estimated cells (PROJECTED vs measured)", ""]

    # 1. memory ranks
    recs = []
    for cell in cells:
        row = runs[0].loc[cell].to_dict()
        spec = costmodel.case_of_row(row)
        mem = analytic.memory(spec)
        recs.append({"cell": cell, "spec": spec, "measured": float(row["peak_mem_bytes"]),
                     "first": float(mem["peak_first"]), "steady": float(mem["peak"])})  # fmt: skip
    m = pd.DataFrame(recs)
    rho_first = spearman(m["first"], m["measured"])
    rho_steady = spearman(m["steady"], m["measured"])
    err = (m["first"] / m["measured"] - 1).abs()
    lines += [
        f"## 1. Memory ranks: {len(m)} measured cells ({', '.join(summaries[:1])})",
        "",
        f"Spearman rank correlation of the analytic peak with the measured peak: "
        f"{rho_first:.4f} (first step, what a run measures), {rho_steady:.4f} (steady state, "
        f"what the planner checks against the cap). |analytic/measured - 1| of the first-step "
        f"peak: median {err.median():.1%}, max {err.max():.1%}.",
        "",
    ]

    # 2. best pick per question
    def group(spec) -> tuple:
        return (spec.seq_len, spec.layout.world_size, spec.mode, spec.batch * spec.layout.dp)

    questions: dict[tuple, list] = {}
    for rec in recs:
        questions.setdefault(group(rec["spec"]), []).append(rec)
    table = []
    ok = 0
    for key, members in sorted(questions.items()):
        if len(members) < 2:
            continue
        configs = []
        for rec in members:
            spec = rec["spec"]
            cand = planner.Candidate(
                spec.strategy, spec.layout, spec.batch, spec.recompute, spec.kv_bucket,
                spec=spec, peak=rec["steady"], fits=True,
            )  # fmt: skip
            conf = planner.Config(spec.strategy, spec.layout, spec.recompute, spec.kv_bucket,
                                  [cand])  # fmt: skip
            planner._count(conf, ops, preset)
            configs.append((conf, rec["cell"]))
        ranked = planner.rank([c for c, _ in configs])
        pick = next(cell for c, cell in configs if c is ranked[0].config)

        def times(cell: str) -> list[float]:
            return sorted(float(r.loc[cell, "step_time_s"]) for r in runs)

        measured = {cell: statistics.median(times(cell)) for _, cell in configs}
        best = min(measured, key=measured.get)
        tp, tb = times(pick), times(best)
        within = tp[0] <= tb[-1]  # the ranges overlap: indistinguishable on this machine
        ok += within
        S, world, mode, gb = key
        table.append(
            f"| S={S} {mode} {world} ranks B={gb} | {len(members)} | {pick} | {best} | "
            f"{measured[pick]:.3f} [{tp[0]:.3f}, {tp[-1]:.3f}] | "
            f"{measured[best]:.3f} [{tb[0]:.3f}, {tb[-1]:.3f}] | "
            f"{'same' if pick == best else ('within noise' if within else 'NO')} |"
        )
    lines += [
        f"## 2. Best pick per question: {len(table)} questions (cells with the same S, ranks, "
        f"mode and global batch), preset {preset['name']}",
        "",
        "Step time: median of the runs [min, max]; within noise: the pick's range reaches the "
        "measured best's.",
        "",
        "| question | cells | planner's pick | measured best | pick s | best s | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *table,
        "",
        f"Pick is the measured best or within its run-to-run range in {ok} of {len(table)}.",
        "",
    ]

    # 3. fits, against the estimator (the cells' specs from their estimate records)
    mem = pd.read_csv(memory_csv)
    cap = costmodel.load_preset(memory_hardware)["memory_bytes"]
    specs = {}
    for f in sorted((Path(memory_csv).parent / "estimates").glob("*.json")):
        e = json.loads(f.read_text())
        spec = RunSpec.make(
            e["strategy"], load_model(e["model"])[0], degree=e["degree"], tp=e["tp"], sp=e["sp"],
            dp=e["dp"], seq_len=e["seq_len"], batch=e["batch"], mode=e["mode"], dtype=e["dtype"],
            recompute=e["recompute"],
        )  # fmt: skip
        specs[(_norm(spec.label), spec.seq_len, spec.recompute)] = spec
    agree, rows = 0, []
    for _, r in mem.iterrows():
        key = (_norm(r["strategy"]), int(r["seq_len"]), str(r["recompute"]))
        if key not in specs:
            raise ConfigError(f"{memory_csv}: no estimate record for {key} beside it")
        peak = float(analytic.memory(specs[key])["peak"])
        same = (peak <= cap) == bool(r["fits"])
        agree += same
        if not same:
            rows.append(f"{r['strategy']} {r['recompute']} S={int(r['seq_len'])}: analytic "
                        f"{peak / GiB:.1f} GiB, estimate {r['peak_gib']:.1f} GiB")  # fmt: skip
    margin = (mem["analytic_gib"] - mem["peak_gib"]).abs()
    lines += [
        f"## 3. Fits, against the fake-tensor estimator: {memory_csv}",
        "",
        f"Cap {cap / GiB:.0f} GiB ({memory_hardware}): the analytic model and the estimator agree "
        f"on which cells fit in {agree} of {len(mem)}"
        + (f"; they disagree on {', '.join(rows)}" if rows else "")
        + f". |analytic - estimate| median {margin.median():.2f} GiB, max {margin.max():.1f} GiB.",
        "",
    ]
    return "\n".join(lines)
