"""Paper-style figures (PNG and PDF, matplotlib with seaborn's theme) from the aggregate table.

Failed cells are never left out quietly: a cell whose status is not ``ok`` is drawn as a red
cross at the top of its axis, labelled OOM or failed. Every strategy keeps one colour, marker
and dash style across all figures, legends list strategies in the registry's order (TSP first)
and TSP is drawn last, on top, so a line it shares with another stays visible. Throughput carries
the timed steps' min-max as error bars; the axis says GPUs or CPU ranks as the records do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib import ticker  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from tspbench.pipeline.aggregate import per_sweep  # noqa: E402
from tspbench.pipeline.tables import (  # noqa: E402
    MARK,
    ORDER,
    device,
    forward,
    groups,
    hardware,
    label_order,
    mem_unit,
)

__all__ = [
    "ORDER",
    "compact",
    "draw_lines",
    "legend",
    "log_ticks",
    "palette",
    "plots",
    "save",
    "styles",
    "write_figures",
]
PARTS = ["weights", "grads", "optimizer state", "activations + buffers"]
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
DASHES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1)), (0, (1, 1)), (0, (6, 2, 1, 2)))
SPREAD = "bars: min-max over the timed steps (points set apart)"


def palette(labels) -> dict[str, tuple]:
    """One colour per strategy label, the same in every figure (tsp first)."""
    ordered = label_order(labels)
    return dict(zip(ordered, sns.color_palette("deep", len(ordered))))


def styles(labels) -> dict[str, tuple[str, object]]:
    """(marker, dash style) per strategy label, in the palette's order: two strategies whose
    lines coincide still look different."""
    return {
        k: (MARKERS[i % len(MARKERS)], DASHES[i % len(DASHES)])
        for i, k in enumerate(label_order(labels))
    }


def save(fig, path_stem: Path) -> list[Path]:
    """Write ``png/<name>.png`` and ``pdf/<name>.pdf`` beside ``path_stem``, atomically."""
    out = []
    for ext in ("png", "pdf"):
        path = path_stem.parent / ext / f"{path_stem.name}.{ext}"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}.tmp.{ext}")
        fig.savefig(tmp, dpi=150, bbox_inches="tight")
        os.replace(tmp, path)
        out.append(path)
    plt.close(fig)
    return out


def compact(v: float, _pos: object = None) -> str:
    """A short tick label: 1500 -> 1.5k, 2e6 -> 2M, 0.5 -> 0.5."""
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:.3g}{suffix}"
    return f"{v:.3g}"


def log_ticks(axis, values) -> None:
    """Labelled major ticks on a log-scaled axis, enough to read a value off: evenly spaced
    round numbers when the values span less than a decade (8k, 10k, 12k, ...), else 1-2-5 in
    each decade (powers of ten past three decades) with unlabelled minor ticks between."""
    v = np.asarray(pd.Series(values).dropna(), dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    decades = np.log10(v.max() / v.min()) if len(v) else 1.0
    if decades < 1:
        axis.set_major_locator(ticker.MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
        axis.set_minor_locator(ticker.NullLocator())
    else:
        subs = (1, 2, 5) if decades < 3 else (1,)
        axis.set_major_locator(ticker.LogLocator(base=10, subs=subs, numticks=50))
        axis.set_minor_locator(ticker.LogLocator(base=10, subs=tuple(range(2, 10)), numticks=50))
        axis.axes.grid(True, which="minor", axis=axis.axis_name, alpha=0.25, lw=0.5)
    axis.set_major_formatter(ticker.FuncFormatter(compact))
    axis.set_minor_formatter(ticker.NullFormatter())


def draw_lines(
    ax,
    df: pd.DataFrame,
    x: str,
    y: str,
    colors: dict,
    marks: dict,
    spread: tuple[str, str] | None = None,
    hue: str = "label",
    dodge: float = 0.0,
) -> list[str]:
    """One line per strategy label (column ``hue``; colour, marker and dash of its own), the
    first in the order (TSP) drawn last, highest and filled, the others hollow; ``spread``:
    (low, high) columns drawn as error bars; ``dodge``: strategies' points moved apart by this
    many octaves each on a log2 x axis, so bars at one x do not hide each other. Returns the
    labels drawn, in the legend's order (TSP first)."""
    present = [k for k in colors if k in set(df[hue])]
    for i in reversed(range(len(present))):
        k = present[i]
        d = df[df[hue] == k].sort_values(x)
        z = 3 + len(present) - i  # the first in the order on top
        xs = d[x] * 2.0 ** ((i - (len(present) - 1) / 2) * dodge) if dodge else d[x]
        marker, dash = marks[k]
        # TSP filled and on top; the others hollow and a little larger, so a marker under it
        # still shows its outline
        face = {} if i == 0 else {"markerfacecolor": "none", "markeredgewidth": 1.5}
        ax.plot(
            xs,
            d[y],
            color=colors[k],
            marker=marker,
            ls=dash,
            lw=1.6,
            ms=5.5 if i == 0 else 9,
            zorder=z,
            label=k,
            **face,
        )
        if spread is not None and len(d):
            lo = (d[y] - d[spread[0]]).clip(lower=0).fillna(0)
            hi = (d[spread[1]] - d[y]).clip(lower=0).fillna(0)
            ax.errorbar(xs, d[y], yerr=[lo, hi], fmt="none", ecolor=colors[k], capsize=3, zorder=z)
    return present


def legend(
    ax, labels: list[str], failed: str = "", title: str = "strategy", fontsize: float = 8
) -> None:
    """The legend outside the axes, on the right (it never hides a point), strategies in
    ``labels`` order, and a red cross named ``failed`` when the axis marks cells so."""
    by_label = dict(zip(*reversed(ax.get_legend_handles_labels())))
    names = [k for k in labels if k in by_label]
    handles = [by_label[k] for k in names]
    if failed:
        handles.append(Line2D([], [], color="red", marker="x", ls="none", ms=7, mew=2))
        names.append(failed)
    ax.legend(
        handles,
        names,
        title=title,
        fontsize=fontsize,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        borderaxespad=0.0,
    )


def _failed_markers(ax, failed: pd.DataFrame, x: str) -> None:
    """A red cross at the top of the axis per failed cell; labels at one x are stacked."""
    if failed.empty:
        return
    top = ax.get_ylim()[1]
    seen: dict[object, int] = {}
    for _, r in failed.iterrows():
        k = seen[r[x]] = seen.get(r[x], -1) + 1
        ax.scatter(r[x], top, marker="x", color="red", s=60, zorder=20, clip_on=False)
        ax.annotate(
            f"{r['label']}: {MARK.get(r['status'], 'failed')}",
            (r[x], top),
            textcoords="offset points",
            xytext=(-4, -12 - 10 * k),
            fontsize=7,
            color="red",
            ha="right",
        )


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
    seq_train = df[(df["sweep"] == "seq") & (df["mode"] == "train")]
    fwd = forward(df)  # each forward-only cell once, from whichever sweeps list it
    fwd_sweeps = "+".join(sorted(set(df.loc[df["cell"].isin(fwd["cell"]), "sweep"])))
    for mode, part in (("train", seq_train), ("infer", fwd)):
        what, sfx = ("training", "") if mode == "train" else ("forward only", "_infer")
        sweep = "seq" if mode == "train" else fwd_sweeps
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
        sc = df[(df["sweep"] == "scaling") & (df["mode"] == mode)]
        for S, part in sc.groupby("seq_len"):
            out.append(
                Plot(
                    f"throughput_vs_gpus_{mode}_S{S}",
                    "scaling",
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
    for sweep in ("batch", "microbatch"):
        for tag, S, mb in groups(df[df["sweep"] == sweep], "seq_len", "S"):
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
    deg = df[df["sweep"] == "degree"]
    for S, part in deg.groupby("seq_len"):
        out.append(
            Plot(
                f"memory_vs_degree_S{S}",
                "degree",
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
    """Lines per strategy over a log2 x axis; failed cells as red crosses."""
    df = p.data
    ok, failed = df[df["status"] == "ok"], df[df["status"] != "ok"]
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
    ax.set_xlabel(p.xlabel)
    ax.set_ylabel(p.ylabel)
    sub = f"{foot}; {SPREAD}" if p.spread else foot
    ax.set_title(f"{p.title}{note}\n{sub}", fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    _failed_markers(ax, failed, p.x)
    legend(ax, drawn, "OOM / failed" if len(failed) else "")
    return fig


def crossover_bs(hidden: int, kv_dim: int, ffn: int) -> float:
    """B*S where TSP's forward traffic equals TP's (docs/method.md section 6):
    (D-1)/D [2h^2 + 2h h_kv + 3hf + 2BS h_kv] = 4 (D-1)/D BSh; = 8h for MHA with f = 4h."""
    return (2 * hidden**2 + 2 * hidden * kv_dim + 3 * hidden * ffn) / (4 * hidden - 2 * kv_dim)


def comm_figure(p: Plot, colors: dict, marks: dict, note: str, foot: str) -> plt.Figure:
    """Bytes per forward pass with the analytic TSP = TP crossover marked."""
    fig = line(p, colors, marks, note, foot)
    ok = p.data[p.data["status"] == "ok"]
    if len(ok):
        r = ok.iloc[0]
        bs = crossover_bs(int(r["hidden"]), int(r["kv_dim"]), int(r["ffn"]))
        s_star = bs / int(r["batch"])
        ax = fig.axes[0]
        ax.axvline(s_star, color="gray", linestyle="--", linewidth=1)
        ax.annotate(
            f"TSP = TP at BS = {bs:.0f}\n(= 8h for MHA, f = 4h; layers only)",
            (s_star, ax.get_ylim()[1] * 0.95),
            fontsize=7,
            ha="left",
            va="top",
            xytext=(4, 0),
            textcoords="offset points",
        )
    return fig


def breakdown(p: Plot, scale: float, note: str, foot: str, colors: dict) -> plt.Figure:
    """Peak memory split into model state (weights, grads, AdamW state) and the rest."""
    df = p.data
    ok = df[df["status"] == "ok"].copy()
    elt = np.where(ok["dtype"] == "bf16", 2, 4)  # bytes per weight/grad element
    ok["weights"] = ok["param_numel"] * elt / scale
    ok["grads"] = ok["param_numel"] * elt / scale
    ok["optimizer state"] = ok["optimizer_numel"] * 4 / scale
    model_state = ok["weights"] + ok["grads"] + ok["optimizer state"]
    ok["activations + buffers"] = (ok["peak_mem_bytes"] / scale - model_state).clip(lower=0)
    ok = ok.set_index("label").reindex([k for k in colors if k in set(ok["label"])])[PARTS]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ok.plot.bar(stacked=True, ax=ax, color=sns.color_palette("muted", len(PARTS)))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_ylabel(p.ylabel)
    ax.set_xlabel("")
    S = int(df["seq_len"].max())
    failed = label_order(df.loc[df["status"] != "ok", "label"])
    extra = f"; no result: {', '.join(failed)}" if failed else ""
    ax.set_title(f"Memory breakdown at S = {S} (training{extra}){note}\n{foot}", fontsize=9)
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
    return out
