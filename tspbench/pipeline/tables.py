"""Paper-style tables (Markdown and LaTeX) from the aggregate table.

Each table is a pivot (strategy x sequence length, or x GPUs, or x micro-batch); a cell that did
not produce a number says why: ``OOM``, ``failed`` (error, missing or corrupt record).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from tspbench.runtime.record import write_atomic

MARK = {"oom": "OOM", "error": "failed", "missing": "failed", "corrupt": "failed"}
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


def latex_text(text: str) -> str:
    """``text`` as LaTeX prints it literally: a caption note such as "50% of runs_2 & more"
    must not end the caption or open a math group (one line: newlines become spaces)."""
    return "".join(LATEX.get(ch, ch) for ch in " ".join(text.splitlines()))


def mem_unit(df: pd.DataFrame) -> tuple[str, float]:
    peak = df["peak_mem_bytes"].max() if "peak_mem_bytes" in df else 0
    return ("GiB", 2**30) if peak and peak > 10 * 2**30 else ("MiB", 2**20)


def _cell(row: pd.Series, value: str, fmt: str) -> str:
    if row["status"] != "ok":
        return MARK.get(row["status"], "failed")
    return fmt.format(row[value])


def pivot(df: pd.DataFrame, index: str, column: str, value: str, fmt: str) -> pd.DataFrame:
    shown = df.assign(shown=[_cell(r, value, fmt) for _, r in df.iterrows()])
    table = shown.pivot_table(index=index, columns=column, values="shown", aggfunc="first")
    table.columns = [str(c) for c in table.columns]
    return table.fillna("-")


def specs(df: pd.DataFrame) -> list[tuple[str, str, pd.DataFrame]]:
    """(name, caption, table) of every table the data supports."""
    unit, scale = mem_unit(df)
    df = df.assign(peak=df["peak_mem_bytes"] / scale, kbytes=df.get("comm_bytes_total", 0) / 1e3)
    out = []
    train = df[(df["mode"] == "train") & (df["sweep"] == "seq")]
    if len(train):
        d = int(train["degree"].iloc[0])
        out.append(
            (
                "memory_vs_seq",
                f"Peak memory per GPU ({unit}) vs sequence length, D = {d}, training step",
                pivot(train, "label", "seq_len", "peak", "{:.2f}"),
            )
        )
        out.append(
            (
                "throughput_vs_seq",
                f"Training throughput (tokens/s) vs sequence length, D = {d}",
                pivot(train, "label", "seq_len", "tokens_per_s", "{:.0f}"),
            )
        )
    for mode in ("train", "infer"):
        sc = df[(df["sweep"] == "scaling") & (df["mode"] == mode)]
        if len(sc):
            for S, part in sc.groupby("seq_len"):
                out.append(
                    (
                        f"scaling_{mode}_S{S}",
                        f"{mode.capitalize()} throughput (tokens/s) vs GPUs, S = {S}",
                        pivot(part, "label", "gpus", "tokens_per_s", "{:.0f}"),
                    )
                )
    comm = df[(df["sweep"].isin(["comm", "seq"])) & (df["mode"] == "infer")]
    if len(comm):
        out.append(
            (
                "comm_vs_seq",
                "Bytes communicated per GPU per forward pass (kB) vs sequence length",
                pivot(comm, "label", "seq_len", "kbytes", "{:.0f}"),
            )
        )
    for sweep in ("batch", "microbatch"):
        mb = df[df["sweep"] == sweep]
        if len(mb):
            out.append(
                (
                    f"{sweep}_memory",
                    f"Peak memory per GPU ({unit}) vs micro-batch",
                    pivot(mb, "label", "batch", "peak", "{:.2f}"),
                )
            )
            out.append(
                (
                    f"{sweep}_throughput",
                    "Throughput (tokens/s) vs micro-batch",
                    pivot(mb, "label", "batch", "tokens_per_s", "{:.0f}"),
                )
            )
    deg = df[df["sweep"] == "degree"]
    if len(deg):
        for S, part in deg.groupby("seq_len"):
            out.append(
                (
                    f"memory_vs_degree_S{S}",
                    f"Peak memory per GPU ({unit}) vs D, S = {S}",
                    pivot(part, "label", "degree", "peak", "{:.2f}"),
                )
            )
    return out


def failures(df: pd.DataFrame) -> pd.DataFrame:
    bad = df[df["status"] != "ok"]
    cols = [c for c in ("cell", "status", "error_message") if c in bad]
    return bad[cols]


def write_tables(df: pd.DataFrame, out_dir: Path, note: str = "") -> list[Path]:
    """Write every table as .md and .tex, plus failures.md; return the Markdown paths."""
    written = []
    for name, caption, table in specs(df):
        md = f"**{caption}**{note}\n\n{table.to_markdown()}\n"
        tex = table.to_latex(caption=latex_text(caption + note), label=f"tab:{name}", escape=True)
        write_atomic(out_dir / "md" / f"{name}.md", md)
        write_atomic(out_dir / "tex" / f"{name}.tex", tex)
        written.append(out_dir / "md" / f"{name}.md")
    fails = failures(df)
    body = fails.to_markdown(index=False) if len(fails) else "No failed cells."
    write_atomic(out_dir / "failures.md", f"**Cells without a result**\n\n{body}\n")
    return written
