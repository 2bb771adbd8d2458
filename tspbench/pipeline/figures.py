"""Paper-style figures (PNG and PDF, matplotlib with seaborn's theme) of the measured sweeps, from
the aggregate table: which figures the table supports (``plots``) and how each is drawn. The
helpers shared with the projected figures live in ``plotting``.

Failed cells are never left out quietly: a cell whose status is not ``ok`` is drawn as a red
cross at the top of its axis, labelled OOM or failed. Every strategy keeps one colour, marker
and dash style across all figures, legends list strategies in the registry's order (TSP first)
and TSP is drawn last, on top, so a line it shares with another stays visible. Throughput carries
the timed steps' min-max as error bars; the axis says GPUs or CPU ranks as the records do. The
decode figures (KV cache, latency, tokens/s vs batch) are drawn by ``decode_figures``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib import ticker  # noqa: E402

from tspbench.pipeline.aggregate import per_sweep  # noqa: E402
from tspbench.pipeline.decode_figures import write_decode_figures  # noqa: E402
from tspbench.pipeline.labels import display  # noqa: E402
from tspbench.pipeline.plotting import (  # noqa: E402
    draw_lines,
    failed_markers,
    legend,
    log_ticks,
    palette,
    save,
    styles,
)
from tspbench.pipeline.tables import (  # noqa: E402
    device,
    forward,
    groups,
    hardware,
    label_order,
    mem_unit,
    moe_rows,
    pipelines,
)
from tspbench.runtime.measure import PARTS, part_column  # noqa: E402

__all__ = [
    "Plot",
    "breakdown",
    "comm_figure",
    "crossover_bs",
    "line",
    "plots",
    "write_figures",
]
SPREAD = "bars: min-max over the timed steps (points set apart)"


@dataclass
class Plot:
    """One figure the data supports: ``data`` (the rows of ``sweep`` it shows), what goes on
    each axis, and its ``kind`` (``line``, ``comm``: a line with the analytic crossover,
    ``breakdown``: stacked bars)."""

    name: str
    sweep: str
    data: pd.DataFrame
    x: str
    y: str
    xlabel: str
    ylabel: str
    title: str
    kind: str = "line"
    logy: bool = False
    spread: tuple[str, str] | None = None


def _with_ranges(df: pd.DataFrame, scale: float) -> pd.DataFrame:
    """Peak memory in ``scale`` units, forward kB, and the tokens/s of the slowest and fastest
    timed step (tokens per step over step_time_max_s and step_time_min_s; no bar without them)."""
    tps = df["tokens_per_s"] if "tokens_per_s" in df else pd.Series(np.nan, index=df.index)
    per_step = tps * df.get("step_time_s", np.nan)
    return df.assign(
        peak=df["peak_mem_bytes"] / scale,
        kb=df.get("comm_bytes_total", np.nan) / 1e3,
        tokens_lo=(per_step / df.get("step_time_max_s", np.nan)).fillna(tps),
        tokens_hi=(per_step / df.get("step_time_min_s", np.nan)).fillna(tps),
    )


def plots(df: pd.DataFrame) -> list[Plot]:
    """Every figure the aggregate table supports; a cell of several sweeps is in each one's."""
    unit, scale = mem_unit(df)
    one, many = device(df)
    df = _with_ranges(per_sweep(df), scale)
    mem = f"peak memory per {one} ({unit})"
    spread = ("tokens_lo", "tokens_hi")
    out: list[Plot] = []
    seq_train = df[(df["role"] == "seq") & (df["mode"] == "train")]
    fwd = forward(df)  # each forward-only cell once, from whichever sweeps list it
    fwd_sweeps = "+".join(sorted(set(df.loc[df["cell"].isin(fwd["cell"]), "sweep"])))
    for mode, part in (("train", seq_train), ("infer", fwd)):
        what, sfx = ("training", "") if mode == "train" else ("forward only", "_infer")
        sweep = "+".join(sorted(set(part["sweep"]))) if mode == "train" else fwd_sweeps
        for tag, d, seq in groups(part, "degree", "D"):
            out += [
                Plot(
                    f"memory_vs_seq{sfx}{tag}",
                    sweep,
                    seq,
                    "seq_len",
                    "peak",
                    "sequence length",
                    mem,
                    f"Peak memory vs sequence length (D = {d}, {what})",
                ),
                Plot(
                    f"throughput_vs_seq{sfx}{tag}",
                    sweep,
                    seq,
                    "seq_len",
                    "tokens_per_s",
                    "sequence length",
                    "tokens/s",
                    f"Throughput vs sequence length (D = {d}, {what})",
                    spread=spread,
                ),
            ]
            ok_lengths = seq.loc[seq["status"] == "ok", "seq_len"]
            if mode == "train" and len(ok_lengths):  # the longest length with results
                longest = seq[seq["seq_len"] == ok_lengths.max()]
                name = f"memory_breakdown{tag}"
                out.append(Plot(name, sweep, longest, "label", "peak", "", mem, "", "breakdown"))
    for mode in ("train", "infer"):
        sc = df[(df["role"] == "scaling") & (df["mode"] == mode)]
        for S, part in sc.groupby("seq_len"):
            out.append(
                Plot(
                    f"throughput_vs_gpus_{mode}_S{S}",
                    "+".join(sorted(set(part["sweep"]))),
                    part,
                    "gpus",
                    "tokens_per_s",
                    many,
                    "tokens/s (all replicas)",
                    f"{'Training' if mode == 'train' else 'Inference'} throughput vs "
                    f"{many} (S = {S})",
                    logy=True,
                    spread=spread,
                )
            )
    if len(fwd):
        out.append(
            Plot(
                "comm_vs_seq",
                fwd_sweeps,
                fwd,
                "seq_len",
                "kb",
                "sequence length",
                f"kB per {one} per forward pass",
                "Bytes communicated vs sequence length (forward)",
                "comm",
            )
        )
    for sweep, rows in df[df["role"] == "batch"].groupby("sweep", sort=False):
        for tag, S, mb in groups(rows, "seq_len", "S"):
            title = f"vs micro-batch (S = {S}, {int(mb['gpus'].max())} {many})"
            out += [
                Plot(
                    f"{sweep}_memory{tag}",
                    sweep,
                    mb,
                    "batch",
                    "peak",
                    "micro-batch",
                    mem,
                    f"Peak memory {title}",
                ),
                Plot(
                    f"{sweep}_throughput{tag}",
                    sweep,
                    mb,
                    "batch",
                    "tokens_per_s",
                    "micro-batch",
                    "tokens/s (all replicas)",
                    f"Throughput {title}",
                    spread=spread,
                ),
            ]
    for (S, D), part in pipelines(df).groupby(["seq_len", "degree"]):
        title = f"vs pipeline stages (D = {D}, S = {S}, the same global batch)"
        sweeps = "+".join(sorted(set(part["sweep"])))
        out += [
            Plot(
                f"pipeline_memory_S{S}_D{D}",
                sweeps,
                part,
                "stages",
                "peak",
                "stages",
                mem,
                f"Peak memory (the fullest stage's) {title}",
            ),  # fmt: skip
            Plot(
                f"pipeline_throughput_S{S}_D{D}",
                sweeps,
                part,
                "stages",
                "tokens_per_s",
                "stages",
                "tokens/s",
                f"Throughput {title}",
                spread=spread,
            ),  # fmt: skip
        ]
    for (E, D), part in moe_rows(df).groupby(["experts", "degree"]):
        title = f"vs sequence length ({E} experts, D = {D}, training)"
        sweeps = "+".join(sorted(set(part["sweep"])))
        out += [
            Plot(f"moe_memory_E{E}_D{D}", sweeps, part, "seq_len", "peak", "sequence length",
                 mem, f"Peak memory {title}"),
            Plot(f"moe_throughput_E{E}_D{D}", sweeps, part, "seq_len", "tokens_per_s",
                 "sequence length", "tokens/s", f"Throughput {title}", spread=spread),
            Plot(f"moe_comm_E{E}_D{D}", sweeps, part, "seq_len", "kb", "sequence length",
                 f"kB sent per {one} per step", f"Bytes sent {title}"),
        ]  # fmt: skip
    deg = df[df["role"] == "degree"]
    for S, part in deg.groupby("seq_len"):
        out.append(
            Plot(
                f"memory_vs_degree_S{S}",
                "+".join(sorted(set(part["sweep"]))),
                part,
                "degree",
                "peak",
                "D (ranks per model group)",
                mem,
                f"Peak memory vs D (S = {S}, training)",
            )
        )
    return out


def line(p: Plot, colors: dict, marks: dict, note: str = "", foot: str = "") -> plt.Figure:
    """Lines per strategy over a log2 x axis, the y axis from 0 (or log, ``logy``); failed
    cells as red crosses. With one x value, a bar per strategy instead (:func:`bars`)."""
    df = p.data
    ok, failed = df[df["status"] == "ok"], df[df["status"] != "ok"]
    if df[p.x].nunique() == 1:
        return bars(p, colors, note, foot)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if ok.empty:  # nothing succeeded: an empty axis that still carries the failure marks
        ax.set_ylim(0, 1)
    dodge = 0.04 if p.spread else 0.0  # error bars of several strategies at one x
    drawn = draw_lines(ax, ok, p.x, p.y, colors, marks, p.spread, dodge=dodge)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(df[p.x].unique()))
    ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    if p.logy and not ok.empty:
        ax.set_yscale("log")
        log_ticks(ax.yaxis, pd.concat([ok[p.y], *(ok[c] for c in p.spread or ())]))
    else:  # memory, bytes, tokens/s: read as ratios, so from 0
        ax.set_ylim(bottom=0)
    ax.set_xlabel(p.xlabel)
    ax.set_ylabel(p.ylabel)
    sub = f"{foot}; {SPREAD}" if p.spread else foot
    ax.set_title(f"{p.title}{note}\n{sub}", fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    failed_markers(ax, failed, p.x)
    legend(ax, drawn, "OOM / failed" if len(failed) else "")
    return fig


def bars(p: Plot, colors: dict, note: str = "", foot: str = "") -> plt.Figure:
    """One bar per strategy where a figure has a single x value (a line would be one point, and
    the error bars' dodge would look like several x values), from 0, with the timed steps'
    spread as error bars; strategies without a result are named in the title."""
    df = p.data
    ok = df[df["status"] == "ok"]
    x = df[p.x].iloc[0]
    order = [k for k in colors if k in set(ok["label"])]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    rows = [ok[ok["label"] == k].iloc[0] for k in order]
    heights = [float(r[p.y]) for r in rows]
    err = None
    if p.spread and rows:
        lo, hi = p.spread
        err = [[h - float(r[lo]) for h, r in zip(heights, rows, strict=True)],
               [float(r[hi]) - h for h, r in zip(heights, rows, strict=True)]]  # fmt: skip
    ax.bar([display(k) for k in order], heights, color=[colors[k] for k in order], yerr=err,
           capsize=3)  # fmt: skip
    ax.set_ylim(bottom=0)
    ax.set_ylabel(p.ylabel)
    failed = label_order(df.loc[df["status"] != "ok", "label"])
    extra = f"; no result: {', '.join(map(display, failed))}" if failed else ""
    where = f"{p.xlabel} = {x:g}" if isinstance(x, (int, float, np.number)) else str(x)
    sub = f"{foot}; bars: min-max over the timed steps" if p.spread else foot
    ax.set_title(f"{p.title}, {where}{extra}{note}\n{sub}", fontsize=9)
    ax.tick_params(axis="x", rotation=20)
    ax.grid(True, axis="y", alpha=0.3)
    return fig


def crossover_bs(hidden: int, kv_dim: int, ffn: int, q_dim: int | None = None) -> float:
    """B*S where TSP's forward traffic equals TP's (docs/method.md section 6):
    (D-1)/D [2h h_q + 2h h_kv + 3hf + 2BS h_kv] = 4 (D-1)/D BSh; = 8h for MHA with f = 4h
    (h_q = h unless the model sets head_dim)."""
    q = hidden if q_dim is None else q_dim
    return (2 * hidden * q + 2 * hidden * kv_dim + 3 * hidden * ffn) / (4 * hidden - 2 * kv_dim)


def comm_figure(p: Plot, colors: dict, marks: dict, note: str, foot: str) -> plt.Figure:
    """Bytes per forward pass with the analytic TSP = TP crossover of the layers marked where it
    falls inside the swept lengths (the measured lines add the embedding's and the loss's
    traffic, so they cross elsewhere: the mark says so), else named in the title."""
    fig = line(p, colors, marks, note, foot)
    ok = p.data[p.data["status"] == "ok"]
    if len(ok) and p.data[p.x].nunique() > 1:
        r = ok.iloc[0]
        q = int(r["q_dim"]) if "q_dim" in r and pd.notna(r["q_dim"]) else None  # older tables
        bs = crossover_bs(int(r["hidden"]), int(r["kv_dim"]), int(r["ffn"]), q)
        s_star = bs / int(r["batch"])
        ax = fig.axes[0]
        lo, hi = p.data[p.x].min(), p.data[p.x].max()
        what = f"analytic TSP = TP of the layers alone at BS = {bs:.0f}"
        if lo <= s_star <= hi:
            ax.axvline(s_star, color="gray", linestyle="--", linewidth=1)
            ax.annotate(
                f"{what}\n(= 8h for MHA, f = 4h; the measured lines\nadd embedding and loss)",
                (s_star, ax.get_ylim()[1] * 0.95),
                fontsize=7,
                ha="left",
                va="top",
                xytext=(4, 0),
                textcoords="offset points",
            )
        else:
            ax.set_title(f"{ax.get_title()}; {what}: S = {s_star:g}, outside", fontsize=9)
    return fig


def breakdown(p: Plot, scale: float, note: str, foot: str, colors: dict) -> plt.Figure:
    """What was live at each strategy's peak, by part, as measured: the record's split of the
    steady-state peak (``peak_parts_bytes``, taken by the tracker at that crest); a strategy
    without a result, or whose record has no split (a table from before the split, a run
    without a warmup step), is named in the title."""
    cols = [part_column(k) for k in PARTS]
    df = p.data.reindex(columns=[*p.data.columns, *(c for c in cols if c not in p.data)])
    ok = df[(df["status"] == "ok") & df[cols].notna().all(axis=1)].copy()
    ok[cols] = ok[cols].astype(float) / scale
    unsplit = label_order(set(df.loc[df["status"] == "ok", "label"]) - set(ok["label"]))
    ok = ok.set_index("label").reindex([k for k in colors if k in set(ok["label"])])[cols]
    ok.columns = list(PARTS)
    ok.index = [display(k) for k in ok.index]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if ok.empty:
        ax.text(0.5, 0.5, "no record here has a measured split", ha="center",
                transform=ax.transAxes)  # fmt: skip
    else:
        ok.plot.bar(stacked=True, ax=ax, color=sns.color_palette("muted", len(PARTS)))
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_ylabel(p.ylabel)
    ax.set_xlabel("")
    ax.set_ylim(bottom=0)
    S = int(df["seq_len"].max())
    failed = label_order(df.loc[df["status"] != "ok", "label"])
    extra = f"; no result: {', '.join(map(display, failed))}" if failed else ""
    extra += f"; not split: {', '.join(map(display, unsplit))}" if unsplit else ""
    ax.set_title(f"Live at the peak, measured, S = {S} (training{extra}){note}\n{foot}", fontsize=9)
    ax.tick_params(axis="x", rotation=20)
    return fig


def write_figures(df: pd.DataFrame, out_dir: Path, note: str = "") -> list[Path]:
    note = note.replace("$", r"\$")  # a note is text, never matplotlib's mathtext
    foot = f"measured on {hardware(df)}".replace("$", r"\$")
    sns.set_theme(style="whitegrid", context="paper")
    _, scale = mem_unit(df)
    colors, marks = palette(df["label"]), styles(df["label"])
    out: list[Path] = []
    for p in plots(df):
        if p.kind == "breakdown":
            fig = breakdown(p, scale, note, foot, colors)
        elif p.kind == "comm":
            fig = comm_figure(p, colors, marks, note, foot)
        else:
            fig = line(p, colors, marks, note, foot)
        out += save(fig, out_dir / p.name)
    return out + write_decode_figures(df, out_dir, colors, marks, note, foot)
