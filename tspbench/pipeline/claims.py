"""The paper's claims side by side with ours: one row per claim (``tspbench claims``).

Each claim of ``workflows/paper/claims.yaml`` gets ``paper`` (the published number and its
source), ``ours`` (measured on this machine, or projected and labelled so, with the cell or file
it came from), a ``verdict`` (holds / partly / differs / not checkable here) and the ``reason``.
Numbers come from fresh pipeline outputs when they exist (``results/projected``,
``results/default``), else from the committed references, so the table is made in seconds.
Physical bounds are claims of their own: no throughput can beat the FLOPs the hardware's peak
rate allows for that model, length and mode. A difference is a finding, never a target.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import yaml

from tspbench.core.config import get_config
from tspbench.pipeline.claim_checks import (
    ROOT,
    Row,
    Sources,
    competitive_rows,
    crossover_rows,
    gap_rows,
    lowest_memory_rows,
    memory_rows,
    microbatch_rows,
    throughput_rows,
)
from tspbench.pipeline.decode_claims import kv_cache_rows, longest_context_rows

__all__ = ["Sources", "claims_table", "write_claims"]


def claims_table(
    path: Path = ROOT / "workflows/paper/claims.yaml", src: Sources | None = None
) -> pd.DataFrame:
    """Every claim of ``path`` against our numbers (one or more rows each)."""
    spec = yaml.safe_load(path.read_text())
    src = src or Sources.find()
    cfg = get_config(spec["model"])
    rows: list[Row] = []
    for c in spec["claims"]:
        kind = c["kind"]
        if kind == "memory":
            rows += memory_rows(c, cfg, src)
        elif kind == "throughput":
            rows += throughput_rows(c, cfg, src)
        elif kind == "lowest_memory":
            rows += lowest_memory_rows(c, src)
        elif kind == "gap_grows":
            rows += gap_rows(c, cfg, src)
        elif kind == "microbatch":
            rows += microbatch_rows(c, src)
        elif kind == "competitive":
            rows += competitive_rows(c, src)
        elif kind == "crossover":
            rows += crossover_rows(c, cfg)
        elif kind == "kv_cache":
            rows += kv_cache_rows(c, cfg, src)
        elif kind == "longest_context":
            rows += longest_context_rows(c, cfg, src)
        else:
            rows.append(Row(c["claim"], "?", "", "not checkable here", f"unknown kind {kind!r}"))
    return pd.DataFrame([r.__dict__ for r in rows])


def write_claims(df: pd.DataFrame, csv: Path | None, md: Path | None) -> str:
    """The table as Markdown (returned, and written to ``md``), and as CSV to ``csv``."""
    from tspbench.runtime.record import write_atomic

    cols = ["claim", "paper", "ours", "verdict", "reason"]
    text = df[cols].to_markdown(index=False)
    counts = ", ".join(f"{n} {v}" for v, n in df["verdict"].value_counts().items())
    text = f"**The paper's claims against ours** ({counts})\n\n{text}\n"
    if csv is not None:
        write_atomic(csv, df.to_csv(index=False))
    if md is not None:
        write_atomic(md, text)
    return text
