"""The figures of a plan map (PROJECTED): ``write_map`` writes ``map.csv`` and, as PNG and PDF,
the winner of every (S, GPUs) cell, each strategy's memory-feasible region and the focus
strategy's margin over the best other. Split from :mod:`.map`, which plans the cells:
drawing them is its own concern (matplotlib, seaborn: imported only here, when drawing).
"""

from __future__ import annotations

import math
from pathlib import Path

from tspbench.runtime.registry import planned


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
    import seaborn as sns

    from tspbench.runtime.record import write_atomic

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "map.csv", table.to_csv(index=False, float_format="%.6g"))
    sns.set_theme(style="white", context="paper")
    cap = table["cap_gib"].iloc[0]
    what = f"{model} {cfg['mode']} {cfg['dtype']} on {hardware} ({cap:.0f} GiB per GPU)"
    cells = table.drop_duplicates(["seq_len", "gpus"]).set_index(["seq_len", "gpus"])
    _winner_figure(table, cells, cfg, what, out)
    _feasible_figure(table, cfg, what, out)
    _margin_figure(table, cells, cfg, what, out)


def _winner_figure(table, cells, cfg: dict, what: str, out: Path) -> None:
    """winner: the winner of every cell (label, D, B, recompute), coloured by strategy."""
    import matplotlib.pyplot as plt
    import numpy as np
    import seaborn as sns
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch

    S, G = cfg["seq_lens"], cfg["gpus"]
    names = list(planned())
    colors = dict(zip(names, sns.color_palette("deep", len(names))))
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


def _feasible_figure(table, cfg: dict, what: str, out: Path) -> None:
    """feasible: each strategy's memory-feasible region, coloured by its best tokens/s per GPU."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    S, G = cfg["seq_lens"], cfg["gpus"]
    names = list(planned())
    n = len(names)
    cols = min(4, n)
    rows_n = math.ceil(n / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.1 * cols, 2.4 * rows_n + 0.6),
                             sharex=True, sharey=True, squeeze=False)  # fmt: skip
    per_gpu = table["tokens_per_s_per_gpu"].dropna()
    norm = LogNorm(per_gpu.min(), per_gpu.max()) if len(per_gpu) else None
    for k, name in enumerate(names):
        ax = axes[k // cols][k % cols]
        im = _feasible_panel(ax, table[table.strategy == name], S, G, norm)
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


def _feasible_panel(ax, rows, S, G, norm):
    """One strategy's panel: its tokens/s per GPU where it fits, an x where it does not; the
    image drawn."""
    import matplotlib.pyplot as plt
    import numpy as np

    d = rows.set_index(["seq_len", "gpus"])
    grid = np.full((len(G), len(S)), np.nan)
    for i, g in enumerate(G):
        for j, s in enumerate(S):
            r = d.loc[(s, g)]
            if r["fits"]:
                grid[i, j] = r["tokens_per_s_per_gpu"]
            else:
                ax.text(j, i, "x", ha="center", va="center", fontsize=7, color="0.45")
    cm = plt.get_cmap("viridis").with_extremes(bad="0.93")
    return ax.imshow(grid, cmap=cm, norm=norm, origin="lower", aspect="auto")


def _recomputes(table, seq_len: int, gpus: int, focus: str) -> str:
    """A cell's note where one side of the margin recomputes and the other does not: the focus
    strategy's best against the best other strategy's (both fitting)."""
    rows = table[(table.seq_len == seq_len) & (table.gpus == gpus) & table.fits.astype(bool)]
    own = rows[rows.strategy == focus]
    others = rows[rows.strategy != focus]
    if own.empty or others.empty:
        return ""
    theirs = others.loc[others.tokens_per_s.astype(float).idxmax(), "recompute"]
    mine = own.recompute.iloc[0]
    if mine == theirs:
        return ""
    return "\nother rc" if theirs == "full" else f"\n{focus} rc"


def _margin_figure(table, cells, cfg: dict, what: str, out: Path) -> None:
    """margin: the focus strategy's margin over the best other strategy in every cell."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    S, G = cfg["seq_lens"], cfg["gpus"]
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
                why = _recomputes(table, s, g, focus)
                ax.text(j, i, f"{pct:+.{1 if abs(pct) >= 0.1 else 2}f}%{why}", ha="center",
                        va="center", fontsize=7 if not why else 6,
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
    fig.text(0.01, -0.04, f"cell: {focus}'s projected tokens/s against the best other strategy's "
             f"(+: {focus} faster); only {focus}: no other strategy fits; {focus} OOM: {focus} "
             f"does not fit; grey: no strategy fits.\nother rc: the best other strategy's best "
             f"plan recomputes activations (a second forward pass) and {focus}'s does not; "
             f"{focus} rc: the reverse. That pass is then most of the margin.",
             fontsize=7)  # fmt: skip
    _save(fig, out, "margin")
