"""Paper-style tables (Markdown, LaTeX and HTML) from the aggregate table.

Each table is a pivot (strategy x sequence length, or x GPUs, or x micro-batch, or x D) of one
sweep (the decode tables, :mod:`decode_tables`, of the decode cells); a cell listed by several
sweeps counts in each (:func:`per_sweep`). Rows follow the strategy registry's order (TSP
first), the same order as the figures' legends. A cell that did not produce a number says why:
``OOM``, ``failed`` (error, missing or corrupt record). The hardware and the unit of parallelism
(GPUs or CPU ranks) come from the records, never from a constant.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import pandas as pd

from tspbench.core.config import ConfigError, ModelConfig, get_config
from tspbench.pipeline.aggregate import per_sweep
from tspbench.pipeline.decode_tables import decode_specs

# what tables and figures share lives in labels; importers find it here too
from tspbench.pipeline.labels import (
    GPU_NAME,
    MARK,
    ORDER,
    device,
    groups,
    hardware,
    label_order,
    mem_unit,
    pivot,
)
from tspbench.runtime.record import write_atomic
from tspbench.runtime.registry import strategies

__all__ = [
    "GPU_NAME",
    "MARK",
    "ORDER",
    "device",
    "forward",
    "groups",
    "hardware",
    "label_order",
    "mem_unit",
    "pivot",
    "report_labels",
    "specs",
    "write_tables",
]

# LaTeX's special characters in running text (pandas escapes cells, never the caption)
LATEX = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}
STYLE = (
    "body{font-family:sans-serif;font-size:14px;margin:1em}"
    "table{border-collapse:collapse}th,td{border:1px solid #bbb;padding:3px 8px;text-align:right}"
    "th{background:#eee}td:first-child{text-align:left}p.hw{color:#555;font-size:12px}"
)


def latex_text(text: str) -> str:
    """``text`` as LaTeX prints it literally: a caption note such as "50% of runs_2 & more"
    must not end the caption or open a math group (one line: newlines become spaces)."""
    return "".join(LATEX.get(ch, ch) for ch in " ".join(text.splitlines()))


def report_labels(summary: str | Path, kind: str, name: str) -> dict[str, str]:
    """The Snakemake report's labels of one table or figure: its name and the hardware its
    sweep's records ran on (read when the report is made, so true for every config)."""
    try:
        where = hardware(pd.read_csv(summary))
    except (OSError, ValueError):
        where = "unknown (no readable summary)"
    return {kind: name, "hardware": where.replace("{", "(").replace("}", ")")}


def forward(df: pd.DataFrame) -> pd.DataFrame:
    """Forward-only cells of the sweeps over length, each once (a cell may be in two)."""
    part = df[(df["role"] == "seq") & (df["mode"] == "infer")]
    return part.drop_duplicates("cell") if "cell" in part else part


def table_model(r: pd.Series) -> ModelConfig | None:
    """The model of a summary row (its preset with the widths the row names; with experts,
    theirs), or None where the row cannot say."""
    try:
        base = get_config(str(r["model"]))
        hidden = int(r["hidden"])
        if "heads" in r and pd.notna(r["heads"]):  # the table names the heads and Q's width
            heads, q = int(r["heads"]), int(r["q_dim"])
        else:  # an older table: heads as the preset's, scaled with h
            heads, q = base.heads * hidden // base.hidden, hidden
        d = q // heads
        experts: dict[str, Any] = {}
        if pd.notna(r.get("experts")) and int(r["experts"]) > 0:
            experts = {k: int(r[k]) for k in ("experts", "top_k", "expert_ffn")}
        return get_config(
            str(r["model"]),
            hidden=hidden,
            heads=heads,
            kv_heads=int(r["kv_dim"]) // d,
            ffn=int(r["ffn"]),
            head_dim=0 if q == hidden else d,
            **experts,
        )
    except (ConfigError, ValueError, TypeError, ZeroDivisionError, KeyError):
        return None


def crossovers(df: pd.DataFrame, mode: str) -> str:
    """The analytic B x S above which TSP moves fewer bytes per rank than TP, for the table's
    model and D (forward pass; per training step with and without recomputation, where the
    weights travel two or three times): a caption's tail, empty if the rows cannot say."""
    from tspbench.projection.analytic import crossover

    need = {"model", "hidden", "kv_dim", "ffn", "degree"}
    ok = df[df["status"] == "ok"] if "status" in df.columns else df
    if not need <= set(ok.columns) or ok.empty:
        return ""
    cfg = table_model(ok.iloc[0])
    if cfg is None:
        return ""
    D = int(ok["degree"].max())
    if D < 2:
        return ""

    def at(m: str, rc: str) -> str:
        x = crossover(cfg, "tsp", "tp", m, rc, degree=D)
        return "never" if x == float("inf") else f"B x S > {x:,.0f} ({x / cfg.hidden:.1f}h)"

    if mode == "infer":
        return f"; TSP moves fewer bytes than TP per forward pass at D = {D} when " + at(
            "infer", "none"
        )
    return (
        f"; TSP moves fewer bytes than TP per training step when {at('train', 'none')} "
        f"(recompute full: {at('train', 'full')}), per forward pass when "
        f"{at('infer', 'none')} (analytic, this model)"
    )


def moe_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The training rows of the sweeps of a model with experts (role ``moe``), one per cell
    (none in a summary from before experts)."""
    rows = df[(df["role"] == "moe") & (df["mode"] == "train")].drop_duplicates("cell")
    return rows if "experts" in rows else rows.iloc[:0].assign(experts=0)


def pipelines(df: pd.DataFrame) -> pd.DataFrame:
    """The training rows of the sweeps with pipeline stages (role ``pipeline``), with their
    ``stages`` (1: none)."""
    rows = df[(df["role"] == "pipeline") & (df["mode"] == "train")]
    stages = rows["pp"].fillna(1).astype(int) if "pp" in rows else 1
    return rows.assign(stages=stages)


def specs(df: pd.DataFrame) -> list[tuple[str, str, pd.DataFrame]]:
    """(name, caption, table) of every table the data supports."""
    unit, scale = mem_unit(df)
    one, many = device(df)
    df = per_sweep(df)
    df = df.assign(peak=df["peak_mem_bytes"] / scale, kbytes=df.get("comm_bytes_total", 0) / 1e3)
    out = []
    seq_train = df[(df["mode"] == "train") & (df["role"] == "seq")]
    for mode, part in (("train", seq_train), ("infer", forward(df))):
        what, sfx = ("training step", "") if mode == "train" else ("forward pass", "_infer")
        for tag, d, g in groups(part, "degree", "D"):
            out.append(
                (
                    f"memory_vs_seq{sfx}{tag}",
                    f"Peak memory per {one} ({unit}) vs sequence length, D = {d}, {what}",
                    pivot(g, "label", "seq_len", "peak", "{:.2f}"),
                )
            )
            out.append(
                (
                    f"throughput_vs_seq{sfx}{tag}",
                    f"{'Training' if mode == 'train' else 'Inference'} throughput (tokens/s) "
                    f"vs sequence length, D = {d}",
                    pivot(g, "label", "seq_len", "tokens_per_s", "{:.0f}"),
                )
            )
    for mode in ("train", "infer"):
        sc = df[(df["role"] == "scaling") & (df["mode"] == mode)]
        for S, part in sc.groupby("seq_len"):
            out.append(
                (
                    f"scaling_{mode}_S{S}",
                    f"{'Training' if mode == 'train' else 'Inference'} throughput (tokens/s, "
                    f"all replicas) vs {many}, S = {S}",
                    pivot(part, "label", "gpus", "tokens_per_s", "{:.0f}"),
                )
            )
    comm = forward(df)
    if len(comm):
        out.append(
            (
                "comm_vs_seq",
                f"Bytes communicated per {one} per forward pass (kB) vs sequence length"
                + crossovers(comm, "infer"),
                pivot(comm, "label", "seq_len", "kbytes", "{:.0f}"),
            )
        )
    for tag, d, g in groups(seq_train, "degree", "D"):
        out.append(
            (
                f"comm_vs_seq_train{tag}",
                f"Bytes communicated per {one} per training step (kB) vs sequence length, "
                f"D = {d}" + crossovers(g, "train"),
                pivot(g, "label", "seq_len", "kbytes", "{:.0f}"),
            )
        )
    for sweep, rows in df[df["role"] == "batch"].groupby("sweep", sort=False):
        for tag, S, mb in groups(rows, "seq_len", "S"):
            out.append(
                (
                    f"{sweep}_memory{tag}",
                    f"Peak memory per {one} ({unit}) vs micro-batch, S = {S}",
                    pivot(mb, "label", "batch", "peak", "{:.2f}"),
                )
            )
            out.append(
                (
                    f"{sweep}_throughput{tag}",
                    f"Throughput (tokens/s, all replicas) vs micro-batch, S = {S}",
                    pivot(mb, "label", "batch", "tokens_per_s", "{:.0f}"),
                )
            )
    for (S, D), part in pipelines(df).groupby(["seq_len", "degree"]):
        out += [
            (
                f"pipeline_memory_S{S}_D{D}",
                f"Peak memory per {one} ({unit}, the largest of any stage's) vs pipeline "
                f"stages, D = {D}, S = {S}, the same global batch",
                pivot(part, "label", "stages", "peak", "{:.2f}"),
            ),
            (
                f"pipeline_throughput_S{S}_D{D}",
                f"Throughput (tokens/s) vs pipeline stages, D = {D}, S = {S}, the same global "
                "batch",
                pivot(part, "label", "stages", "tokens_per_s", "{:.0f}"),
            ),
        ]
    deg = df[df["role"] == "degree"]
    for S, part in deg.groupby("seq_len"):
        out.append(
            (
                f"memory_vs_degree_S{S}",
                f"Peak memory per {one} ({unit}) vs D, S = {S}",
                pivot(part, "label", "degree", "peak", "{:.2f}"),
            )
        )
    out += moe_specs(df, unit)
    out += implementation_specs(df[(df["mode"] == "train") & (df["role"] != "moe")], unit)
    return out + decode_specs(df, one, unit, scale)  # decode, generate (decode_tables)


def moe_specs(df: pd.DataFrame, unit: str) -> list[tuple[str, str, pd.DataFrame]]:
    """The sweeps of a model with experts (role ``moe``): each strategy and expert schedule vs
    sequence length, per number of experts and D: peak memory per rank, training throughput,
    and bytes sent per rank and step (the experts' all-to-all, or their weights, among them)."""
    out: list[tuple[str, str, pd.DataFrame]] = []
    for (E, D), g in moe_rows(df).groupby(["experts", "degree"]):
        what = f"a model with {E} experts, D = {D}, training step"
        out += [
            (
                f"moe_memory_E{E}_D{D}",
                f"Peak memory per rank ({unit}) vs sequence length, {what}",
                pivot(g, "label", "seq_len", "peak", "{:.2f}"),
            ),
            (
                f"moe_throughput_E{E}_D{D}",
                f"Training throughput (tokens/s) vs sequence length, {what}",
                pivot(g, "label", "seq_len", "tokens_per_s", "{:.0f}"),
            ),
            (
                f"moe_comm_E{E}_D{D}",
                f"Bytes sent per rank and step (kB) vs sequence length, {what}: the all-to-all "
                "moves token rows, the ring and broadcast schedules expert weights"
                + expert_crossovers(g, int(D)),
                pivot(g, "label", "seq_len", "kbytes", "{:.0f}"),
            ),
        ]
    return out


def expert_crossovers(g: pd.DataFrame, D: int) -> str:
    """The analytic B x S above which TSP's ring of experts moves fewer bytes per rank than its
    all-to-all of token rows (even routing), per training step and forward pass: a caption's
    tail, empty if the rows cannot say."""
    from tspbench.projection.analytic import expert_crossover

    ok = g[g["status"] == "ok"] if "status" in g else g
    cfg = table_model(ok.iloc[0]) if len(ok) and "top_k" in ok else None
    if cfg is None or not cfg.moe or D < 2:
        return ""
    rc = str(ok["recompute"].iloc[0]) if "recompute" in ok else "none"
    train, fwd = (expert_crossover(cfg, m, r, D) for m, r in (("train", rc), ("infer", "none")))
    return (
        f"; the experts' ring moves fewer bytes than the all-to-all when B x S > {train:,.0f} "
        f"per training step (recompute {rc}), {fwd:,.0f} per forward pass (analytic, even "
        "routing)"
    )


def implementation_specs(df: pd.DataFrame, unit: str) -> list[tuple[str, str, pd.DataFrame]]:
    """Another library's implementation of a layout beside the suite's, on the cells both ran
    alike (length, D, GPUs, micro-batch, dtype, recomputation, the options both take; the
    suite's at its defaults of the options the other lacks): peak memory and bytes per rank,
    tokens/s of all replicas, and the ratio of theirs to ours (below 1: theirs leaner, or
    slower)."""
    out = []
    ok = df[df["status"] == "ok"].drop_duplicates("cell")
    for name, impl in strategies().items():
        if impl.implements is None:
            continue
        base = strategies()[impl.implements]
        shared = [o.name for o in impl.options if o.name in {b.name for b in base.options}]
        cols = [k for k in ("seq_len", "degree", "gpus", "batch", "dtype", "recompute", *shared)
                if k in ok]  # fmt: skip
        ours = ok[ok["strategy"] == impl.implements]
        for o in base.options:  # the suite's options the other implementation does not have
            if o.name not in shared and o.name in ours:
                ours = ours[ours[o.name].isna() | (ours[o.name] == o.default)]
        own = [o.name for o in impl.options if o.name not in shared and o.name in ok]
        theirs = ok[ok["strategy"] == name].drop_duplicates(cols + own)  # each of its settings
        both = theirs.merge(ours.drop_duplicates(cols), on=cols, suffixes=(" t", " o"))
        if both.empty:
            continue
        us, them = base.display, impl.display
        table = pd.DataFrame(index=both.index)
        for what, col, fmt in (
            (f"peak ({unit})", "peak", "{:.2f}"),
            ("kB sent", "kbytes", "{:.0f}"),
            ("tokens/s", "tokens_per_s", "{:.0f}"),
        ):
            t, o = both[f"{col} t"], both[f"{col} o"]
            table[f"{what} {us}"] = o.map(fmt.format)
            table[f"{what} {them}"] = t.map(fmt.format)
            table[f"{what} ratio"] = (t / o).map("{:.3f}".format)
        keys = [*cols, *(f"{k} t" if k in ours else k for k in own)]
        table.index = [
            " ".join(f"{k.removesuffix(' t')}={v}" for k, v in zip(keys, row))
            for row in both[keys].itertuples(index=False)
        ]
        table.index.name = "cell"
        out.append(
            (
                f"implementations_{name}",
                f"{them} against {us}, the same training cells (ratio: theirs / ours; below 1 "
                "is leaner memory or bytes, or lower tokens/s)",
                table,
            )
        )
    return out


def failures(df: pd.DataFrame) -> pd.DataFrame:
    bad = df[df["status"] != "ok"]
    cols = [c for c in ("cell", "status", "error_message") if c in bad]
    return bad[cols]


def html_page(title: str, caption: str, body: str, foot: str = "") -> str:
    """A small self-contained HTML page (the report shows it as it is)."""
    head = f'<meta charset="utf-8"><title>{html.escape(title)}</title><style>{STYLE}</style>'
    foot = f'<p class="hw">{html.escape(foot)}</p>\n' if foot else ""
    return (
        f"<!DOCTYPE html>\n<html><head>{head}</head><body>\n"
        f"<p><b>{html.escape(caption)}</b></p>\n{body}\n{foot}</body></html>\n"
    )


def write_tables(df: pd.DataFrame, out_dir: Path, note: str = "") -> list[Path]:
    """Write every table as .md, .tex and .html, plus failures.md and failures.html; return the
    Markdown paths."""
    written = []
    hw = f"Measured on: {hardware(df)}."
    for name, caption, table in specs(df):
        md = f"**{caption}**{note}\n\n{table.to_markdown()}\n\n{hw}\n"
        tex = table.to_latex(
            caption=latex_text(f"{caption}{note}. {hw}"), label=f"tab:{name}", escape=True
        )
        body = table.reset_index().to_html(index=False, escape=True)  # one header row
        page = html_page(name, caption + note, body, hw)
        write_atomic(out_dir / "md" / f"{name}.md", md)
        write_atomic(out_dir / "tex" / f"{name}.tex", tex)
        write_atomic(out_dir / "html" / f"{name}.html", page)
        written.append(out_dir / "md" / f"{name}.md")
    fails = failures(df)
    body = fails.to_markdown(index=False) if len(fails) else "No failed cells."
    write_atomic(out_dir / "failures.md", f"**Cells without a result**\n\n{body}\n")
    body = fails.to_html(index=False, escape=True) if len(fails) else "<p>No failed cells.</p>"
    write_atomic(out_dir / "failures.html", html_page("failures", "Cells without a result", body))
    return written
