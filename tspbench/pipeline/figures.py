"""Paper-style figures (PNG and PDF, seaborn) from the aggregate table.

Failed cells are never left out quietly: a cell whose status is not ``ok`` is drawn as a red
cross at the top of its axis, labelled OOM or failed. Every strategy keeps one colour across
all figures.
"""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib import ticker  # noqa: E402

from tspbench.pipeline.tables import MARK, mem_unit  # noqa: E402
from tspbench.runtime.registry import strategies  # noqa: E402

ORDER = list(strategies())  # the registry's order: TSP first
PARTS = ["weights", "grads", "optimizer state", "activations + buffers"]


def palette(labels) -> dict[str, tuple]:
    """One colour per strategy label, the same in every figure (tsp first)."""
    ordered = sorted(set(labels), key=lambda s: (ORDER.index(s.split(" ")[0]), s))
    return dict(zip(ordered, sns.color_palette("deep", len(ordered))))


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


def _failed_markers(ax, failed: pd.DataFrame, x: str) -> None:
    """A red cross at the top of the axis per failed cell; labels at one x are stacked."""
    if failed.empty:
        return
    top = ax.get_ylim()[1]
    seen: dict[object, int] = {}
    for _, r in failed.iterrows():
        k = seen[r[x]] = seen.get(r[x], -1) + 1
        ax.scatter(r[x], top, marker="x", color="red", s=60, zorder=5, clip_on=False)
        ax.annotate(
            f"{r['label']}: {MARK.get(r['status'], 'failed')}",
            (r[x], top),
            textcoords="offset points",
            xytext=(-4, -12 - 10 * k),
            fontsize=7,
            color="red",
            ha="right",
        )


def line(df, x, y, ylabel, title, xlabel, colors, logy=False, note="") -> plt.Figure:
    """Lines per strategy over a log2 x axis; failed cells as red crosses."""
    ok, failed = df[df["status"] == "ok"], df[df["status"] != "ok"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if ok.empty:  # nothing succeeded: an empty axis that still carries the failure marks
        ax.set_ylim(0, 1)
    order = [k for k in colors if k in set(df["label"])]
    sns.lineplot(
        data=ok,
        x=x,
        y=y,
        hue="label",
        hue_order=order,
        style="label",
        style_order=order,
        palette=colors,
        markers=True,
        dashes=False,
        ax=ax,
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(df[x].unique()))
    ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
    if logy:
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_locator(ticker.LogLocator(base=2, subs=(1.0, 1.5)))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title + note, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    _failed_markers(ax, failed, x)
    ax.legend(title="strategy", fontsize=8)
    return fig


def crossover_bs(hidden: int, kv_dim: int, ffn: int) -> float:
    """B*S where TSP's forward traffic equals TP's (docs/method.md section 6):
    (D-1)/D [2h^2 + 2h h_kv + 3hf + 2BS h_kv] = 4 (D-1)/D BSh; = 8h for MHA with f = 4h."""
    return (2 * hidden**2 + 2 * hidden * kv_dim + 3 * hidden * ffn) / (4 * hidden - 2 * kv_dim)


def breakdown(df, unit: str, scale: float, note: str, colors: dict) -> plt.Figure:
    """Peak memory split into model state (weights, grads, AdamW state) and the rest."""
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
    ax.set_ylabel(f"peak memory per GPU ({unit})")
    ax.set_xlabel("")
    S = int(df["seq_len"].max())
    failed = sorted(set(df.loc[df["status"] != "ok", "label"]))
    extra = f"; no result: {', '.join(failed)}" if failed else ""
    ax.set_title(f"Memory breakdown at S = {S} (training{extra})" + note, fontsize=10)
    ax.tick_params(axis="x", rotation=20)
    return fig


def write_figures(df: pd.DataFrame, out_dir: Path, note: str = "") -> list[Path]:
    note = note.replace("$", r"\$")  # a note is text, never matplotlib's mathtext
    sns.set_theme(style="whitegrid", context="paper")
    unit, scale = mem_unit(df)
    df = df.assign(peak=df["peak_mem_bytes"] / scale)
    colors = palette(df["label"])
    out: list[Path] = []
    seq = df[(df["sweep"] == "seq") & (df["mode"] == "train")]
    if len(seq):
        d = int(seq["degree"].iloc[0])
        fig = line(
            seq,
            "seq_len",
            "peak",
            f"peak memory per GPU ({unit})",
            f"Peak memory vs sequence length (D = {d}, training)",
            "sequence length",
            colors,
            note=note,
        )
        out += save(fig, out_dir / "memory_vs_seq")
        fig = line(
            seq,
            "seq_len",
            "tokens_per_s",
            "tokens/s",
            f"Throughput vs sequence length (D = {d}, training)",
            "sequence length",
            colors,
            note=note,
        )
        out += save(fig, out_dir / "throughput_vs_seq")
        ok_lengths = seq.loc[seq["status"] == "ok", "seq_len"]
        if len(ok_lengths):  # the longest length with results (failed cells: see the tables)
            longest = seq[seq["seq_len"] == ok_lengths.max()]
            out += save(breakdown(longest, unit, scale, note, colors), out_dir / "memory_breakdown")
    for mode in ("train", "infer"):
        sc = df[(df["sweep"] == "scaling") & (df["mode"] == mode)]
        for S, part in sc.groupby("seq_len"):
            fig = line(
                part,
                "gpus",
                "tokens_per_s",
                "tokens/s (all replicas)",
                f"{mode.capitalize()} throughput vs GPUs (S = {S})",
                "GPUs",
                colors,
                logy=True,
                note=note,
            )
            out += save(fig, out_dir / f"throughput_vs_gpus_{mode}_S{S}")
    comm = df[(df["sweep"].isin(["comm", "seq"])) & (df["mode"] == "infer")]
    if len(comm):
        comm = comm.assign(kb=comm["comm_bytes_total"] / 1e3)
        fig = line(
            comm,
            "seq_len",
            "kb",
            "kB per GPU per forward pass",
            "Bytes communicated vs sequence length (forward)",
            "sequence length",
            colors,
            note=note,
        )
        ok = comm[comm["status"] == "ok"]
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
        out += save(fig, out_dir / "comm_vs_seq")
    return out
