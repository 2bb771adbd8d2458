"""PROJECTED serving at paper scale, without the hardware (``decode`` of projected.yaml): the KV
cache per GPU against the prompt length, and the longest prompt each strategy can serve within
a GPU memory budget, from the analytic decode memory of ``tspbench.projection.decode`` (the
larger of the prefill's peak, a forward pass with the cache alive, and a decode step's).

The longest prompt is the largest multiple of ``GRAIN`` tokens whose peak fits the budget (the
peak grows with the prompt, so a bisection finds it); every figure and table says PROJECTED and
names the hardware presets whose memory it marks. Not validated against hardware.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pandas as pd
from matplotlib import ticker

from tspbench.core.config import ConfigError, get_config
from tspbench.core.strategy import Layout
from tspbench.pipeline.labels import is_reference, label_order
from tspbench.pipeline.plotting import draw_lines, legend, log_ticks, palette, save, styles
from tspbench.projection.costmodel import load_preset, usable_memory
from tspbench.projection.decode import memory
from tspbench.runtime.record import write_atomic
from tspbench.runtime.registry import get_strategy
from tspbench.runtime.spec import RunSpec

__all__ = ["GRAIN", "decode_tables", "longest_prompt", "write_decode_report"]
GiB = 2**30
GRAIN = 1024  # prompt lengths searched: multiples of 1024 (zigzag needs 2D, 2 Sigma)
LONGEST = 2**24  # the CLI's longest sequence


def _spec(cfg: dict, strategy: str, layout, P: int, batch: int) -> RunSpec:
    return RunSpec(
        strategy=strategy,
        cfg=get_config(cfg["model"]),
        layout=layout,
        seq_len=P,
        batch=batch,
        mode="decode",
        new_tokens=cfg["decode"]["new_tokens"],
        dtype=cfg["dtype"],
    )


def _layouts(cfg: dict) -> list[tuple[str, Layout]]:
    """(strategy, model group) at the config's degree (the single-device reference's sweep
    layout is one GPU whatever the degree)."""
    out = []
    for s in cfg["decode"]["strategies"]:
        lays = get_strategy(s).sweep_layouts([cfg["degree"]], cfg["tpsp"])
        out += [(s, lay) for lay in lays]
    return out


def _peak(cfg: dict, strategy: str, layout, batch: int):
    """Peak bytes per GPU as a function of the prompt length (remembered: a bisection asks for
    each length once per budget)."""

    @functools.cache
    def peak(P: int) -> float:
        return memory(_spec(cfg, strategy, layout, P, batch))["peak"]

    return peak


def longest_prompt(peak, budget: float) -> int:
    """The largest multiple of GRAIN up to LONGEST with ``peak(P) <= budget`` (0: none)."""
    lo, hi = 0, LONGEST // GRAIN  # peak(lo * GRAIN) fits (or lo = 0), hi + 1 is unknown
    if peak(hi * GRAIN) <= budget:
        return hi * GRAIN
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid * GRAIN) <= budget else (lo, mid)
    return lo * GRAIN if lo and peak(lo * GRAIN) <= budget else 0


def decode_tables(cfg: dict) -> dict[str, pd.DataFrame]:
    """``kv_cache``: KV cache and peak per GPU per (strategy, prompt length) at the smallest
    batch; ``context``: the longest prompt per (strategy, batch, budget)."""
    dec = cfg["decode"]
    presets = [usable_memory(load_preset(h)) / GiB for h in cfg["hardware"]]
    budgets = sorted({*dec["budgets_gib"], *presets})
    kv, context = [], []
    for s, lay in _layouts(cfg):
        for P in dec["seq_lens"]:
            m = memory(_spec(cfg, s, lay, P, min(dec["batches"])))
            kv.append(
                {
                    "strategy": _spec(cfg, s, lay, P, 1).label,
                    "batch": min(dec["batches"]),
                    "seq_len": P,
                    "kv_cache_gib": m["kv_cache_bytes"] / GiB,
                    "peak_gib": m["peak"] / GiB,
                    "peak_at": m["peak_at"],
                }
            )
        for B in dec["batches"]:
            peak = _peak(cfg, s, lay, B)
            for budget in budgets:
                P = longest_prompt(peak, budget * GiB)
                row = {
                    "strategy": _spec(cfg, s, lay, GRAIN, 1).label,
                    "batch": B,
                    "budget_gib": budget,
                    "longest_prompt": P,
                }
                if P:
                    m = memory(_spec(cfg, s, lay, P, B))
                    row |= {"kv_cache_gib": m["kv_cache_bytes"] / GiB, "peak_at": m["peak_at"]}
                context.append(row)
    return {"kv_cache": pd.DataFrame(kv), "context": pd.DataFrame(context)}


def _tokens(v: float, _pos=None) -> str:
    """A prompt length as 16K, 1M, 1.5M."""
    return f"{v / 2**20:.3g}M" if v >= 2**20 else f"{v / 2**10:.3g}K"


def _same_cache_note(ax, kv: pd.DataFrame) -> None:
    """Name the strategies whose caches coincide (their lines lie on one another), and their
    cache against the single-device one."""
    at = kv[kv.seq_len == kv.seq_len.max()]
    single = at.loc[is_reference(at.strategy), "kv_cache_gib"]
    lines = []
    for gib, g in at.groupby(at.kv_cache_gib.map(lambda v: float(f"{v:.3g}"))):  # 3 digits
        names = label_order(g.strategy)
        if len(names) > 1 or not is_reference(g.strategy).all():
            ratio = f" = single / {single.iloc[0] / gib:.3g}" if len(single) else ""
            lines.append(f"{', '.join(names)}{ratio}")
    if lines:
        ax.text(
            0.03, 0.97, "\n".join(lines), transform=ax.transAxes, fontsize=7, va="top",
            bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"},
        )  # fmt: skip


def _draw(cfg: dict, tables: dict[str, pd.DataFrame], path: Path) -> None:
    import matplotlib.pyplot as plt
    import seaborn as sns

    dec, kv, ctx = cfg["decode"], tables["kv_cache"], tables["context"]
    sns.set_theme(style="whitegrid", context="paper")
    labels = label_order(kv.strategy)
    colors, marks = palette(labels), styles(labels)
    n = 1 + len(dec["batches"])
    fig, axes = plt.subplots(1, n, figsize=(4.3 * n + 1.4, 4.2))
    ax = axes[0]
    draw_lines(ax, kv, "seq_len", "kv_cache_gib", colors, marks, hue="strategy")
    ax.set(
        xscale="log", yscale="log", xlabel="prompt length (tokens)", ylabel="KV cache per GPU (GiB)"
    )
    ax.set_xticks(sorted(kv.seq_len.unique()), [_tokens(v) for v in sorted(kv.seq_len.unique())])
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    log_ticks(ax.yaxis, kv.kv_cache_gib)
    ax.set_title(f"KV cache per GPU, batch {int(kv.batch.iloc[0])}", fontsize=9)
    _same_cache_note(ax, kv)
    presets = {h: usable_memory(load_preset(h)) / GiB for h in cfg["hardware"]}
    for ax, B in zip(axes[1:], dec["batches"]):
        d = ctx[(ctx.batch == B) & (ctx.longest_prompt > 0)]
        draw_lines(ax, d, "budget_gib", "longest_prompt", colors, marks, hue="strategy")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="GPU memory budget (GiB)",
            ylabel="longest prompt served (tokens)",
        )
        ticks = sorted(set(dec["budgets_gib"]))
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.yaxis.set_major_locator(ticker.LogLocator(base=2, numticks=30))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(_tokens))
        ax.yaxis.set_minor_locator(ticker.NullLocator())
        for i, (h, gib) in enumerate(sorted(presets.items(), key=lambda kv: kv[1])):
            ax.axvline(gib, color="0.45", ls="--", lw=0.9, zorder=1)
            ax.annotate(
                f"{h.upper()} {gib:g} GiB",
                (gib, 0.02 + 0.07 * i),
                xycoords=("data", "axes fraction"),
                rotation=90,
                fontsize=7,
                color="0.3",
                ha="right",
                va="bottom",
            )
        ax.set_title(f"longest prompt that fits, batch {B}", fontsize=9)
    legend(axes[-1], labels)
    fig.suptitle(
        f"PROJECTED decode serving, {cfg['model']} {cfg['dtype']}, D = {cfg['degree']} (single: "
        f"1 GPU), {dec['new_tokens']} new tokens: analytic memory per GPU (the larger of the "
        "prefill's and a decode step's peak), not measured",
        fontsize=9,
    )
    fig.tight_layout()
    save(fig, path)


def write_decode_report(cfg: dict, out: Path, plots: Path, note: str) -> None:
    """``decode_kv_cache`` and ``decode_context`` tables (CSV, Markdown) under ``out``, and the
    ``decode_context_projected`` figure under ``plots``, all labelled projected."""
    try:
        tables = decode_tables(cfg)
    except ConfigError as e:  # a strategy or length the decode path refuses
        raise ConfigError(f"projected config: decode: {e}") from None
    ctx = tables["context"]
    presets = {usable_memory(load_preset(h)) / GiB: h for h in cfg["hardware"]}
    wide = ctx[ctx.budget_gib.isin(presets)].assign(
        hardware=lambda d: d.budget_gib.map(presets),
        cell=lambda d: d.longest_prompt.map(lambda P: _tokens(P) if P else "does not fit"),
    )
    wide = wide.pivot_table(
        index=["batch", "strategy"], columns="hardware", values="cell", aggfunc="first"
    )
    order = [(B, s) for B in cfg["decode"]["batches"] for s in label_order(ctx.strategy)]
    wide = wide.reindex([r for r in order if r in wide.index])[list(presets.values())]
    title = "Longest prompt served per GPU (PROJECTED, analytic decode memory)"
    text = f"# {title}\n\n{note}\n\n" + wide.reset_index().to_markdown(index=False) + "\n"
    write_atomic(out / "decode_context.md", text)
    for name, df in tables.items():
        write_atomic(out / f"decode_{name}.csv", df.to_csv(index=False))
    _draw(cfg, tables, plots / "decode_context_projected")
