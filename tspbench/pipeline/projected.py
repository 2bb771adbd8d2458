"""Paper-scale tables and figures without the hardware, every one labelled "projected".

Memory: one fake-tensor estimate per (strategy, S, recompute) cell (``tspbench estimate``,
rank 0, fused attention kernel), checked against the device's memory. Throughput: the cost model
(``tspbench project``) on each hardware preset: tokens/s against S on one node, scaling from 8 to
1024 GPUs (D = 8 in a node, data parallel across), and the micro-batch sweep on 16 GPUs with the
analytic memory deciding which micro-batches fit.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tspbench.core.config import ConfigError, get_config
from tspbench.core.options import only_where_used
from tspbench.core.strategy import Layout
from tspbench.pipeline.labels import display, label_order
from tspbench.pipeline.plotting import (
    draw_lines,
    legend,
    log_ticks,
    log_x,
    palette,
    save,
    seq_axis,
    styles,
)
from tspbench.pipeline.projected_decode import write_decode_report
from tspbench.projection.analytic import memory
from tspbench.projection.costmodel import (
    counted_ops,
    load_preset,
    project,
    project_range,
    ratio_ranges,
    usable_memory,
)
from tspbench.runtime.record import write_atomic
from tspbench.runtime.registry import get_strategy, names, preset_chosen
from tspbench.runtime.spec import RunSpec

GiB = 2**30


@dataclass(frozen=True)
class Cell:
    """One fake-tensor memory estimate: a training step of ``spec`` on rank 0."""

    spec: RunSpec

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def id(self) -> str:
        return f"{self.spec.impl.tag(self.spec.layout)}.S{self.spec.seq_len}.{self.spec.recompute}"

    def args(self) -> list[str]:
        """``tspbench estimate`` arguments of this cell."""
        return self.spec.to_argv()


def layouts(cfg: dict, strategies: list[str]) -> list[tuple[str, Layout]]:
    """(strategy, model group) pairs at the config's degree (TP+SP: its factorisations)."""
    pairs = [(s, get_strategy(s).sweep_layouts([cfg["degree"]], cfg["tpsp"])) for s in strategies]
    return [(s, lay) for s, lays in pairs for lay in lays]


def _spec(
    cfg: dict, strategy: str, layout: Layout, S: int, *, dp=1, batch=1, mode="train", rc="none",
    options: dict | None = None,
) -> RunSpec:  # fmt: skip
    """A replica of ``batch`` sequences per rank's worth of work (DP: one per rank)."""
    lay = replace(layout, dp=dp)
    return RunSpec(
        strategy=strategy,
        cfg=get_config(cfg["model"]),
        layout=lay,
        seq_len=S,
        batch=get_strategy(strategy).replica_batch(lay, batch),
        mode=mode,
        dtype=cfg["dtype"],
        recompute=rc,
        options=options or {},
    )


def variants(cfg: dict, strategy: str) -> list[dict]:
    """The option settings a strategy is projected at: every combination of the values the
    config's ``throughput.options`` lists for options it declares (none: its defaults), an
    option that matters only under another's value at its default elsewhere."""
    impl = get_strategy(strategy)
    declared = {o.name for o in impl.options}
    axes = [[(k, v) for v in vs] for k, vs in cfg["throughput"].get("options", {}).items()
            if k in declared]  # fmt: skip
    return only_where_used(impl.options, [dict(c) for c in itertools.product(*axes)])


def variant_rows(cfg: dict, strategies: list[str]) -> list[tuple[str, Layout, dict]]:
    """(strategy, model group, options) of every projected row: each layout at each of its
    strategy's :func:`variants`, but a combination that layout refuses (a2a+p2p over TP+SP's
    Sigma = 2: no inner group below it); one that every layout refuses is the config's
    ConfigError."""
    rows: list[tuple[str, Layout, dict]] = []
    refused: dict[tuple[str, tuple], ConfigError] = {}
    for s, lay in layouts(cfg, strategies):
        for opts in variants(cfg, s):
            try:
                _spec(cfg, s, lay, cfg["throughput"]["seq_lens"][0], options=opts)
            except ConfigError as e:
                what = get_strategy(s).label(lay) + "".join(f" {k}={v}" for k, v in opts.items())
                refused.setdefault((s, tuple(opts.items())), ConfigError(f"{what}: {e}"))
                continue
            rows.append((s, lay, opts))
    for (s, items), err in refused.items():
        if not any(r[0] == s and tuple(r[2].items()) == items for r in rows):
            raise err
    return rows


def memory_cells(cfg: dict) -> list[Cell]:
    m = cfg["memory"]
    return [
        Cell(_spec(cfg, s, lay, S, rc=rc))
        for s, lay in layouts(cfg, m["strategies"])
        for S in m["seq_lens"]
        for rc in m["recompute"]
    ]


def memory_table(cfg: dict, estimates: Path) -> pd.DataFrame:
    rows = []
    limit = cfg["device_memory_gib"] * GiB
    for cell in memory_cells(cfg):
        rec = json.loads((estimates / f"{cell.id}.json").read_text())
        rows.append(
            {
                "strategy": cell.label,
                "recompute": cell.spec.recompute,
                "seq_len": cell.spec.seq_len,
                "peak_gib": rec["peak_mem_bytes"] / GiB,
                "analytic_gib": memory(cell.spec)["peak"] / GiB,
                "fits": rec["peak_mem_bytes"] <= limit,
                "estimate_s": rec["estimate_s"],
            }
        )
    return pd.DataFrame(rows)


def _ratio_columns(rows: list[dict], group: list[tuple[int, RunSpec, int]], preset: dict) -> None:
    """Each row's tokens/s over the fastest row of another strategy in its group (same preset,
    mode and S; not its own variants), lowest and highest over every corner of the preset's
    rate ranges (:func:`~tspbench.projection.costmodel.ratio_ranges`)."""
    if len(group) < 2:
        return
    ranges = ratio_ranges([(c, n) for _, c, n in group], preset)
    for (i, _, _), (lo, hi) in zip(group, ranges):
        rows[i] |= {"ratio_to_best_low": lo, "ratio_to_best_high": hi}


def _row(c: RunSpec, hw: str, label: str) -> dict[str, object]:
    """A row's hardware, strategy (one label on every preset: its variant's, not what a preset
    chooses) and the options presets choose."""
    chosen = {k: c.options.get(k) for k in preset_chosen()}  # None: the strategy has none
    return {"hardware": hw, "strategy": label, **chosen}


def throughput_tables(cfg: dict) -> dict[str, pd.DataFrame]:
    """The cost model's tables on every preset, TSP with the preset's MLP schedule, as
    ``tspbench project`` and the planner take it."""
    t = cfg["throughput"]
    by_seq: list[dict] = []
    scaling: list[dict] = []
    batches: list[dict] = []
    for hw in cfg["hardware"]:
        preset = load_preset(hw)
        cap = usable_memory(preset)

        def spec(*args, preset=preset, **kw) -> RunSpec:  # TSP: the preset's MLP schedule,
            c = _spec(cfg, *args, **kw)  # but never over an option the config lists
            return c.preset_options(preset, named=list(kw.get("options") or {}))

        cases: dict[tuple, list] = {}  # (mode, S): (row index, case, operations) of each layout
        for s, lay, opts in variant_rows(cfg, t["strategies"]):
            label = _spec(cfg, s, lay, t["seq_lens"][0], options=opts).label
            for mode in ("train", "infer"):
                for S in t["seq_lens"]:
                    c = spec(s, lay, S, mode=mode, rc=t["recompute"], options=opts)
                    p, m = project(c, preset), memory(c)
                    lo, hi = project_range(c, preset, ops=counted_ops(p))
                    cases.setdefault((mode, S), []).append((len(by_seq), c, counted_ops(p)))
                    by_seq.append(
                        {
                            **_row(c, hw, label),
                            "mode": mode,
                            "seq_len": S,
                            "tokens_per_s_per_gpu": p["tokens_per_s"] / c.degree,
                            "step_time_s": p["step_time_s"],
                            "step_time_low_s": lo,
                            "step_time_high_s": hi,
                            "mfu": p["mfu"],
                            "peak_gib_analytic": m["peak"] / GiB,
                            "fits": m["peak"] <= cap,
                        }
                    )
            for gpus in t["gpus"]:
                for S in t["scaling_seq_lens"]:
                    c = spec(s, lay, S, dp=gpus // cfg["degree"], mode="infer", options=opts)
                    p = project(c, preset)
                    scaling.append(
                        {
                            **_row(c, hw, label),
                            "gpus": gpus,
                            "seq_len": S,
                            "tokens_per_s": p["tokens_per_s"],
                            "fits": memory(c)["peak"] <= cap,
                        }
                    )
            for B in t["batches"]:
                S, dp = t["batch_seq_len"], t["batch_gpus"] // 8
                c = spec(s, lay, S, dp=dp, batch=B, rc=t["recompute"], options=opts)
                p, m = project(c, preset), memory(c)
                batches.append(
                    {
                        **_row(c, hw, label),
                        "batch": B,
                        "tokens_per_s": p["tokens_per_s"],
                        "peak_gib_analytic": m["peak"] / GiB,
                        "fits": m["peak"] <= cap,
                    }
                )
        for group in cases.values():
            _ratio_columns(by_seq, group, preset)
    return {
        "throughput_vs_seq": pd.DataFrame(by_seq),
        "scaling": pd.DataFrame(scaling),
        "microbatch": pd.DataFrame(batches),
    }


def _lines(ax, d: pd.DataFrame, x: str, y: str, colors: dict, marks: dict) -> bool:
    """One line per strategy (the suite's colour, marker and dash; TSP drawn last, on top), and
    a red cross on every cell that would not fit in the device's memory; True if any."""
    draw_lines(ax, d, x, y, colors, marks, hue="strategy")
    oom = d[~d.fits.astype(bool)]
    ax.scatter(oom[x], oom[y], marker="x", color="red", s=70, linewidths=2, zorder=30)
    return len(oom) > 0


def _ranges(ax, d: pd.DataFrame, colors: dict) -> None:
    """The range over the preset's stated rate uncertainty (``rate_ranges``) of TSP and of the
    best other layout (the highest mean tokens/s of the panel), as shaded bands: tokens/s at
    the slowest and at the fastest corner (ten overlapping bands would hide each other)."""
    means = d.groupby("strategy").tokens_per_s_per_gpu.mean()
    first = "tsp" if "tsp" in set(d.strategy) else label_order(d.strategy)[0]
    others = means[[k.split()[0] != first.split()[0] for k in means.index]]  # not its variants
    shown = [first, others.idxmax()] if len(others) else [first]
    for label, g in d[d.strategy.isin(shown)].groupby("strategy"):
        g = g.sort_values("seq_len")
        tokens = g.tokens_per_s_per_gpu * g.step_time_s  # per step and GPU
        ax.fill_between(g.seq_len, tokens / g.step_time_high_s, tokens / g.step_time_low_s,
                        color=colors[label], alpha=0.12, linewidth=0, zorder=1)  # fmt: skip


def _legend(ax, d: pd.DataFrame, oom: bool, fontsize: float = 8) -> None:
    """The strategies' legend outside the axes, on the right, with the red cross if used."""
    legend(ax, label_order(d.strategy), "would not fit" if oom else "", fontsize=fontsize)


def _fits(oom: bool, hw: str) -> str:
    """What the red crosses mean, or that there are none."""
    return f"red x: would not fit on {hw}" if oom else f"every cell fits on {hw}"


@contextmanager
def _figure(path: Path, ncols: int = 1, **kw) -> Iterator[tuple[Any, Any]]:
    """A figure with ``ncols`` axes, laid out, saved (PNG and PDF) and closed on exit."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, **kw)
    yield fig, axes
    fig.tight_layout()
    save(fig, path)
    plt.close(fig)


def _md(df: pd.DataFrame, title: str, note: str) -> str:
    return f"# {title}\n\n{note}\n\n" + df.to_markdown(index=False, floatfmt=".3g") + "\n"


def _ordered(df: pd.DataFrame, hardware: list[str]) -> pd.DataFrame:
    """Rows by hardware (the config's order), then strategy (the registry's order, TSP first);
    the rest keeps the order the rows were made in (stable sort)."""
    rank = {k: i for i, k in enumerate([*hardware, *label_order(df.strategy)])}
    return df.sort_values(["hardware", "strategy"], key=lambda c: c.map(rank), kind="stable")


THROUGHPUT_TABLES = ("throughput_vs_seq", "scaling", "microbatch")  # throughput_tables' keys


def report_files(cfg: dict) -> list[str]:
    """The tables ``write_report`` writes under ``out``, by name: the workflow declares each as
    an output (its figures are the ``plots`` folder)."""
    names = ["memory.md", "memory.csv"]
    names += [f"{t}.{ext}" for t in THROUGHPUT_TABLES for ext in ("csv", "md")]
    if "decode" in cfg:
        names += ["decode_context.md", "decode_kv_cache.csv", "decode_context.csv"]
    return names


def write_report(cfg: dict, estimates: Path, out: Path, plots: Path, command: str) -> None:
    """Tables (Markdown, CSV) under ``out`` and figures under ``plots``, all marked projected."""
    import seaborn as sns

    out.mkdir(parents=True, exist_ok=True)
    note = _report_note(cfg, command)
    mem = memory_table(cfg, estimates)
    _write_memory_tables(cfg, mem, out, note)
    tables = throughput_tables(cfg)
    for name, df in tables.items():
        df = _ordered(df, cfg["hardware"])
        write_atomic(out / f"{name}.csv", df.to_csv(index=False))
        write_atomic(out / f"{name}.md", _md(df, name.replace("_", " "), note))

    sns.set_theme(style="whitegrid", context="paper")
    # every label any table shows (the throughput tables add the exchanges' variants)
    labels = label_order(pd.concat([mem.strategy, *(t.strategy for t in tables.values())]))
    colors, marks = palette(labels), styles(labels)
    _plot_memory(cfg, mem, plots, colors, marks)
    _plot_throughput(cfg, tables["throughput_vs_seq"], plots, colors, marks)
    _plot_scaling(cfg, tables["scaling"], plots, colors, marks)
    _plot_microbatch(cfg, tables["microbatch"], plots, colors, marks)
    if "decode" in cfg:  # serving: KV cache per GPU, longest prompt per memory budget
        write_decode_report(cfg, out, plots, note)


def _report_note(cfg: dict, command: str) -> str:
    """The paragraph every table carries: what is projected, from what, made by which command."""
    hw0 = cfg["hardware"][0]
    return (
        f"**Projected**, not measured: {cfg['model']} model, {cfg['dtype']}, D = {cfg['degree']}. "
        f"Memory: fake-tensor estimates of the real code (rank 0, fused flash-attention memory; "
        f"TSP with the ring MLP, `tspbench run`'s default), "
        f"device memory {cfg['device_memory_gib']} GiB (usable on {hw0}). Throughput: cost model "
        f"on the named hardware preset (tspbench/projection/hardware.json), each strategy with "
        f"the options its topology chooses ({', '.join(f'`{k}`' for k in preset_chosen())}). "
        f"Made by: `{command}`."
    )


def _write_memory_tables(cfg: dict, mem: pd.DataFrame, out: Path, note: str) -> None:
    """memory.md (peak GiB per recompute and strategy by S, OOM marked) and memory.csv."""
    wide = mem.assign(
        cell=[f"{p:.1f}" + ("" if f else " (OOM)") for p, f in zip(mem.peak_gib, mem.fits)]
    ).pivot_table(
        index=["recompute", "strategy"], columns="seq_len", values="cell", aggfunc="first"
    )
    rows = [(rc, s) for rc in cfg["memory"]["recompute"] for s in label_order(mem.strategy)]
    wide = wide.reindex([r for r in rows if r in wide.index])  # config's recompute, TSP first
    wide.columns = [f"S={c // 1024}K" for c in wide.columns]
    write_atomic(out / "memory.md", _md(wide.reset_index(), "Peak memory per GPU (GiB)", note))
    write_atomic(out / "memory.csv", mem.to_csv(index=False))


def _plot_memory(cfg: dict, mem: pd.DataFrame, plots: Path, colors: dict, marks: dict) -> None:
    """memory_projected: peak GiB per GPU by S, without and with full recompute."""
    hw0 = cfg["hardware"][0]
    mem_gib = cfg["device_memory_gib"]
    with _figure(plots / "memory_projected", 2, figsize=(11, 4), sharey=True) as (fig, axes):
        oom = False
        for ax, rc in zip(axes, ("none", "full")):
            d = mem[mem.recompute == rc]
            oom |= _lines(ax, d, "seq_len", "peak_gib", colors, marks)
            ax.axhline(mem_gib, color="red", ls="--", lw=1, zorder=2)
            ax.text(  # just right of the first points: above the line, clear of the markers
                d.seq_len.min() * 2**0.15,
                mem_gib * 1.04,
                f"{hw0} memory ({mem_gib} GiB)",
                color="red",
                va="bottom",
                bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none", "pad": 1},
            )
            ax.set(yscale="log", xlabel="sequence length", ylabel="peak GiB per GPU")
            ax.set_title(f"recompute {rc}")
            seq_axis(ax, d.seq_len)
            log_ticks(ax.yaxis, [*mem.peak_gib, mem_gib])
        _legend(axes[-1], mem, oom)
        fig.suptitle(
            f"PROJECTED peak memory, {cfg['model']} train, D={cfg['degree']} (fake tensors); "
            f"red x: above {hw0}'s {mem_gib} GiB"
        )


def _plot_throughput(cfg: dict, ts: pd.DataFrame, plots: Path, colors: dict, marks: dict) -> None:
    """throughput_projected: training tokens/s per GPU by S, one panel per hardware preset."""
    n_hw = len(cfg["hardware"])
    size = (4.2 * n_hw + 1.2, 3.8)
    # one y range for every preset's panel (they compare hardware), from 0
    with _figure(plots / "throughput_projected", n_hw, figsize=size, sharey=True) as (fig, axes):
        oom = False
        for ax, hw in zip(np.atleast_1d(axes), cfg["hardware"]):
            d = ts[(ts.hardware == hw) & (ts["mode"] == "train")]
            oom |= _lines(ax, d, "seq_len", "tokens_per_s_per_gpu", colors, marks)
            _ranges(ax, d, colors)
            chosen = (f"{k} {'/'.join(map(str, d[k].dropna().unique()))}" for k in preset_chosen())
            ax.set(xlabel="sequence length", ylabel="tokens/s per GPU")
            ax.set_ylim(bottom=0)
            ax.set_title(f"{hw.upper()} (projected; {'; '.join(chosen)})")
            seq_axis(ax, d.seq_len)
        _legend(np.atleast_1d(axes)[-1], ts, oom)
        fig.suptitle(
            f"PROJECTED training throughput, {cfg['model']}, one node (D={cfg['degree']}); "
            "bands: TSP's and the best other layout's range over the rates; red x: would not "
            "fit (analytic memory)"
        )


def _plot_scaling(cfg: dict, sc: pd.DataFrame, plots: Path, colors: dict, marks: dict) -> None:
    """scaling_projected: forward tokens/s by GPUs at the longest S on the first preset, and
    the same relative to the first strategy (TSP)."""
    hw0 = cfg["hardware"][0]
    S = max(sc.seq_len)
    d = sc[(sc.hardware == hw0) & (sc.seq_len == S)]
    ref = label_order(d.strategy)[0]  # TSP: the others relative to it, where lines coincide
    base = d[d.strategy == ref].set_index("gpus").tokens_per_s
    rel = d.assign(ratio=d.tokens_per_s / d.gpus.map(base))
    with _figure(plots / "scaling_projected", 2, figsize=(11.5, 4.2)) as (fig, (ax, ax2)):
        oom = _lines(ax, d, "gpus", "tokens_per_s", colors, marks)
        ax.set(yscale="log", xlabel="GPUs", ylabel="tokens/s (forward)", title="all replicas")
        log_ticks(ax.yaxis, d.tokens_per_s)
        oom |= _lines(ax2, rel, "gpus", "ratio", colors, marks)
        vs = f"relative to {display(ref)}"
        ax2.set(xlabel="GPUs", ylabel=f"tokens/s {vs}", title=vs)
        ax2.set_ylim(bottom=0)
        for a in (ax, ax2):
            log_x(a, d.gpus, str)
        _legend(ax2, d, oom)
        fig.suptitle(
            f"PROJECTED forward scaling on {hw0}, S={S // 1024}K (D={cfg['degree']} per node, "
            f"data parallel across nodes); {_fits(oom, hw0)}"
        )


def _plot_microbatch(cfg: dict, mb: pd.DataFrame, plots: Path, colors: dict, marks: dict) -> None:
    """microbatch_projected: training tokens/s by micro-batch on the first preset."""
    hw0 = cfg["hardware"][0]
    d = mb[mb.hardware == hw0]
    with _figure(plots / "microbatch_projected", figsize=(6.8, 4.2)) as (_, ax):
        oom = _lines(ax, d, "batch", "tokens_per_s", colors, marks)
        ax.set(
            xlabel="micro-batch",
            ylabel="tokens/s (train)",
            ylim=(0, None),
            title=f"PROJECTED micro-batch sweep, {cfg['throughput']['batch_gpus']} x {hw0.upper()}"
            f"\n{_fits(oom, hw0)} (analytic memory)",
        )
        log_x(ax, d.batch, str)
        _legend(ax, d, oom)


def load(path: str) -> dict[str, Any]:
    """The projection config, checked against its schema before any value reaches the estimate
    rule's shell line or the report (one-line ConfigError), the fit cap filled in."""
    from tspbench.pipeline.cells import check_option_values, check_schema, read_yaml

    cfg = read_yaml(path, "projected config")
    check_schema(
        cfg, "projected.schema.yaml", f"projected config {str(path)!r}", strategies=names()
    )
    t = cfg["throughput"]
    check_option_values("throughput.options", t.get("options", {}), t["strategies"])
    variant_rows(cfg, t["strategies"])  # a combination no layout takes (kv_backward=save with
    # the K/V ring): one line, now
    usable = usable_memory(load_preset(cfg["hardware"][0])) / GiB  # as every fit decision uses
    return {"device_memory_gib": round(usable, 1), **cfg}
