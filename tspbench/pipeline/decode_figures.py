"""Decode figures (modes ``decode`` and ``generate``, docs/decode.md) from the aggregate table,
drawn as the other measured figures are (``plotting``: one colour, marker and dash per strategy,
TSP on top, the legend outside, red crosses for failed cells).

- ``kv_cache_vs_seq``: the KV cache per rank (left) and the peak memory per rank, the cache
  included (right), against the prompt length; a dotted line marks the single-device cache / D,
  what a cache split by sequence over D ranks holds.
- ``decode_latency_vs_seq``: the decode latency per token against the prompt length, bars up to
  the 90th percentile.
- ``decode_throughput_vs_batch``: decode tokens/s (batch / latency per token) against the batch,
  bars down to the batch over the 90th-percentile latency.

Groups are those of the tables (:func:`decode_tables.decode_groups`); ranks are GPUs or CPU
ranks as the records say.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib import ticker  # noqa: E402

from tspbench.pipeline.decode_tables import decode_groups, decoding, describe, kv_unit  # noqa: E402
from tspbench.pipeline.labels import device, is_reference, label_order, mem_unit  # noqa: E402
from tspbench.pipeline.plotting import (  # noqa: E402
    draw_lines,
    failed_markers,
    legend,
    log_ticks,
    save,
)

__all__ = ["DecodePlot", "decode_plots", "draw", "write_decode_figures"]
DODGE = 0.04  # octaves between strategies' points where bars are drawn
REFERENCE_LINE = "single / D"


@dataclass
class DecodePlot:
    """One decode figure: its ``kind`` (kv, latency, throughput), the decode rows it shows and
    the group's fixed values (``key``), and the sweeps its cells come from."""

    name: str
    kind: str
    data: pd.DataFrame
    key: dict
    sweep: str


def _sweeps(df: pd.DataFrame, rows: pd.DataFrame) -> str:
    """The sweeps of ``rows``' cells (``a+b``), as the other figures name theirs."""
    if "sweep" not in df:
        return ""
    names = df.loc[df["cell"].isin(rows["cell"]), "sweep"].astype(str).str.split(";").explode()
    return "+".join(sorted(set(names)))


def decode_plots(df: pd.DataFrame) -> list[DecodePlot]:
    """Every decode figure the aggregate table supports."""
    if decoding(df).empty:
        return []
    out = []
    for tag, key, g in decode_groups(df, "seq_len"):
        sweep = _sweeps(df, g)
        out.append(DecodePlot(f"kv_cache_vs_seq{tag}", "kv", g, key, sweep))
        out.append(DecodePlot(f"decode_latency_vs_seq{tag}", "latency", g, key, sweep))
    for tag, key, g in decode_groups(df, "batch"):
        name = f"decode_throughput_vs_batch{tag}"
        out.append(DecodePlot(name, "throughput", g, key, _sweeps(df, g)))
    return out


def _log2_x(ax, values) -> None:
    """A log2 x axis with a labelled tick at each swept value and nothing else."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(values)))
    ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
    ax.xaxis.set_minor_locator(ticker.NullLocator())


def _panel(ax, d: pd.DataFrame, x: str, y: str, colors, marks, spread=None, logy=False) -> list:
    """Lines of the ok cells, red crosses for the others; the labels drawn."""
    ok, failed = d[d["status"] == "ok"], d[d["status"] != "ok"]
    if ok.empty:
        ax.set_ylim(0, 1)
    drawn = draw_lines(ax, ok, x, y, colors, marks, spread, dodge=DODGE if spread else 0.0)
    _log2_x(ax, d[x])
    if logy and not ok.empty:
        ax.set_yscale("log")
        log_ticks(ax.yaxis, ok[y])
    elif not ok.empty:
        ax.set_ylim(bottom=0)
    ax.grid(True, which="major", alpha=0.3)
    failed_markers(ax, failed, x)
    return drawn


def _reference(ax, ax2, d: pd.DataFrame, D: int) -> bool:
    """The single-device cache over D, dotted: where a cache split by sequence lies (and its
    entry on ``ax2``, which holds the legend); a note names the strategies whose caches are
    equal, since their lines coincide."""
    ok = d[d["status"] == "ok"]
    is_ref = is_reference(ok["strategy"])
    ref = ok[is_ref].sort_values("seq_len")
    at = ok[ok["seq_len"] == ok["seq_len"].max()]
    at_ref = is_ref[at.index]
    single, split = at.loc[at_ref, "kv"], at[~at_ref]
    notes = []
    for _, g in split.groupby(split["kv"].map(lambda v: f"{v:.3g}")):  # equal to 3 digits
        ratio = f" = single / {single.iloc[0] / g['kv'].iloc[0]:.3g}" if len(single) else ""
        notes.append(", ".join(label_order(g["label"])) + ratio)
    if notes:
        box = {"facecolor": "white", "alpha": 0.8, "lw": 0}
        text = "cache per rank: " + "; ".join(notes)
        ax.text(0.03, 0.97, text, transform=ax.transAxes, fontsize=7, va="top", bbox=box)
    if ref.empty or D < 2:
        return False
    style = {"color": "0.2", "ls": ":", "lw": 1.4, "label": REFERENCE_LINE}
    ax.plot(ref["seq_len"], ref["kv"] / D, zorder=20, **style)  # on top: dotted over the lines
    ax2.plot([], [], **style)  # the legend's entry
    return True


def draw(
    p: DecodePlot, colors: dict, marks: dict, df: pd.DataFrame, note="", foot=""
) -> plt.Figure:
    """The figure of ``p`` (``df``: the whole table, for the units and the device's name)."""
    one, _ = device(df)
    d, what = p.data, describe(p.key)
    failed = "OOM / failed" if (d["status"] != "ok").any() else ""
    if p.kind == "kv":
        unit, scale = mem_unit(df)
        kv_name, kv_scale, _ = kv_unit(d["kv_cache_bytes"])
        d = d.assign(kv=d["kv_cache_bytes"] / kv_scale, peak=d["peak_mem_bytes"] / scale)
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11.5, 4.2))
        drawn = _panel(ax, d, "seq_len", "kv", colors, marks, logy=True)
        _panel(ax2, d, "seq_len", "peak", colors, marks)
        extra = [REFERENCE_LINE] if _reference(ax, ax2, d, int(p.key["degree"])) else []
        ax.set(xlabel="prompt length (tokens)", ylabel=f"KV cache per {one} ({kv_name})")
        ax.set_title("KV cache (allocated for prompt + new tokens)", fontsize=9)
        ax2.set(xlabel="prompt length (tokens)", ylabel=f"peak memory per {one} ({unit})")
        ax2.set_title("peak memory (weights, KV cache, activations)", fontsize=9)
        legend(ax2, drawn + extra, failed)
        fig.suptitle(f"KV cache and peak memory per {one} vs prompt length ({what}){note}\n{foot}",
                     fontsize=9)  # fmt: skip
        fig.tight_layout()
        return fig
    fig, ax = plt.subplots(figsize=(6.6, 4.2))
    if p.kind == "latency":
        d = d.assign(ms=d["decode_latency_s"] * 1e3, p90=d["decode_latency_p90_s"] * 1e3)
        drawn = _panel(ax, d, "seq_len", "ms", colors, marks, spread=("ms", "p90"))
        ax.set(xlabel="prompt length (tokens)", ylabel="decode latency per token (ms)")
        title = "Decode latency per token vs prompt length"
        bars = "points: median over the timed decode steps, bars up to the 90th percentile"
    else:
        d = d.assign(lo=d["batch"] / d["decode_latency_p90_s"])
        drawn = _panel(ax, d, "batch", "decode_tokens_per_s", colors, marks, spread=("lo", "lo"))
        ax.set(xlabel="batch (sequences decoded together)", ylabel="decode tokens/s")
        title = "Decode throughput vs batch"
        bars = "tokens/s = batch / median latency per token; bars down to batch / 90th percentile"
    ax.set_title(f"{title} ({what}){note}\n{foot}; {bars}", fontsize=8)
    legend(ax, drawn, failed)
    return fig


def write_decode_figures(
    df: pd.DataFrame, out_dir: Path, colors: dict, marks: dict, note: str = "", foot: str = ""
) -> list[Path]:
    """Every decode figure as PNG and PDF under ``out_dir`` (png/, pdf/)."""
    out: list[Path] = []
    for p in decode_plots(df):
        out += save(draw(p, colors, marks, df, note, foot), out_dir / p.name)
    return out
