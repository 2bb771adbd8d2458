"""The figure helpers the measured figures (``figures``) and the projected ones (``projected``)
share, kept apart so both draw alike: a strategy's colour, marker and dash style, the same in
every figure (``palette``, ``styles``); lines with TSP drawn last, on top (``draw_lines``); the
legend outside the axes (``legend``); readable log-axis ticks (``log_ticks``, ``compact``; one
per swept value: ``log_x``, ``seq_axis``); red crosses for failed cells (``failed_markers``);
and PNG + PDF written atomically (``save``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib import ticker  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from tspbench.pipeline.labels import ORDER, display  # noqa: E402
from tspbench.pipeline.tables import MARK, label_order  # noqa: E402
from tspbench.runtime.registry import strategies  # noqa: E402

__all__ = [
    "compact",
    "draw_lines",
    "failed_markers",
    "legend",
    "log_ticks",
    "log_x",
    "palette",
    "save",
    "seq_axis",
    "styles",
]
MARKERS: tuple[object, ...] = ("o", "s", "^", "D", "v", "P", "X", (8, 1, 0), "p", "H", "d", "8")
# one per strategy (the eighth an eight-pointed star); a strategy's variants (factorisations,
# options) take the ones below, whose last four are also strategies' markers (MARKERS[8:]), free
# while the registry holds at most eight strategies
VARIANT_MARKERS = ("*", "<", ">", "1", "2", "3", "4", "+", "x", "|", "_", "8", "p", "h", "H", "d")
DASHES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1)), (0, (1, 1)), (0, (6, 2, 1, 2)))


def _strategy(label: str) -> tuple[int, str]:
    """(the strategy's place in the registry, the label's variant: its factorisation or
    schedule, '' for the plain strategy); an unknown label goes after every strategy."""
    name, _, variant = str(label).partition(" ")
    return (ORDER.index(name) if name in ORDER else len(ORDER)), variant


def _combined(variant: str) -> tuple[int, int] | None:
    """(factorisation number, option label number), both from 1, of a variant that is a
    factorisation and an option's label (``(2x4) (a2a)``: TP+SP with its exchange); else None."""
    m = re.fullmatch(r"\((\d+)x(\d+)\) (\(.+\))", variant)
    if not m or (int(m[1]), int(m[2])) not in FACTORISATIONS or m[3] not in _option_labels():
        return None
    return 1 + FACTORISATIONS.index((int(m[1]), int(m[2]))), 1 + _option_labels().index(m[3])


def _variant_no(variant: str) -> int:
    """0 for the plain strategy; a factorisation ``(TxS)`` by its place among all power-of-two
    factorisations (2x4 and 4x2 differ, 2x2 and 2x4 too); an option's label by its place among
    the labels the registry's options give (``(a2a)``, ``(ring)``, ``(broadcast MLP)``...),
    any other by a stable hash of its name: the same number in every figure and run."""
    if not variant:
        return 0
    m = re.fullmatch(r"\((\d+)x(\d+)\)", variant)
    if m and int(m[1]) in POW2 and int(m[2]) in POW2:
        return 1 + FACTORISATIONS.index((int(m[1]), int(m[2])))
    known = _option_labels()
    if variant in known:
        return 1 + len(FACTORISATIONS) + known.index(variant)
    return (
        1
        + len(FACTORISATIONS)
        + len(known)
        + int(hashlib.blake2b(variant.encode(), digest_size=2).hexdigest(), 16) % 40
    )


@functools.cache
def _option_labels() -> list[str]:
    """Every label a strategy option's value other than its default adds (sorted)."""
    return sorted(
        {o.label.format(value=o.text(v)).strip() for s in strategies().values()
         for o in s.options if o.label for v in o.values() if v != o.default}
    )  # fmt: skip


POW2 = [2**k for k in range(11)]
FACTORISATIONS = sorted(((t, s) for t in POW2 for s in POW2), key=lambda f: (f[0] * f[1], f[0]))
SHADES = (0.0, 0.35, -0.35, 0.6, -0.2)  # a variant's colour: the strategy's, lighter or darker


def _shade(colour: tuple, amount: float) -> tuple:
    """``colour`` mixed with white (amount > 0) or black (< 0)."""
    target = 1.0 if amount > 0 else 0.0
    return tuple(c + (target - c) * abs(amount) for c in colour[:3])


def palette(labels) -> dict[str, tuple]:
    """One colour per strategy, fixed by its place in the registry: the same in every figure
    whatever else the figure shows; a variant takes a lighter or darker shade of it."""
    colours = sns.color_palette("deep", 10)
    out = {}
    for k in label_order(labels):
        i, variant = _strategy(k)
        v = _variant_no(variant)
        out[k] = _shade(colours[i % len(colours)], SHADES[v % len(SHADES)] if v else 0.0)
    return out


def styles(labels) -> dict[str, tuple[object, object]]:
    """(marker, dash style) per label, fixed like the colour: the strategy's own marker, and for
    a variant (factorisation, schedule) a marker, dash and shade by its number, so two lines
    that coincide still look different and a label looks the same in every figure."""
    out: dict[str, tuple[object, object]] = {}
    for k in label_order(labels):
        i, variant = _strategy(k)
        both = _combined(variant)
        if both is not None:  # a polygon of its own: sides by the option, angle by the factors
            f, o = both
            out[k] = ((2 + o, 1 + f % 2, (15 * f + 7 * i) % 360), DASHES[(i + f + o) % len(DASHES)])
            continue
        v = _variant_no(variant)
        pick = (v + 2 * i) % len(VARIANT_MARKERS)  # two strategies' same variant differ
        mark = VARIANT_MARKERS[pick] if v else MARKERS[i % len(MARKERS)]
        out[k] = (mark, DASHES[(i + v) % len(DASHES)])
    return out


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
            label=display(k),
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
    names = [display(k) for k in labels if display(k) in by_label]
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


def failed_markers(ax, failed: pd.DataFrame, x: str) -> None:
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


def log_x(ax, values, fmt) -> None:
    """Log-scaled x axis with a labelled tick at each swept value and nothing else."""
    ticks = sorted(set(values))
    ax.set_xscale("log")
    ax.set_xticks(ticks, [fmt(v) for v in ticks])
    ax.xaxis.set_minor_locator(ticker.NullLocator())


def seq_axis(ax, seq_lens) -> None:
    """Log-scaled sequence axis labelled 16K, 32K, ... and nothing else."""
    log_x(ax, seq_lens, lambda s: f"{s // 1024}K")
