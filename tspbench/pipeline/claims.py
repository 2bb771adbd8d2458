"""The paper's claims side by side with ours: one row per claim (``tspbench claims``).

Each claim of ``tspbench/data/claims.yaml`` (or ``--claims``) gets ``paper`` (the published
number and its source), ``ours`` (measured on this machine, or projected and labelled so, with the
cell or file it came from), a ``verdict`` (holds / partly / differs / not checkable here; and
``projected: holds`` / ``projected: partly`` where only our projection answers) and the
``reason``.
Numbers come from fresh pipeline outputs when they exist (``results/projected``,
``results/default``), else from the committed references (both under the current directory),
so the table is made in seconds.
Physical bounds are claims of their own: no throughput can beat the FLOPs the hardware's peak
rate allows for that model, length and mode. A difference is a finding, never a target.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from tspbench.core import datafiles
from tspbench.core.config import get_config
from tspbench.core.configfile import check_schema, read_yaml
from tspbench.pipeline import claim_checks as checks
from tspbench.pipeline import claim_projected as projected
from tspbench.pipeline.claim_checks import Row, Sources
from tspbench.pipeline.decode_claims import kv_cache_rows, longest_context_rows
from tspbench.pipeline.moe_claims import experts_rows
from tspbench.runtime.registry import names

__all__ = ["CHECKS", "CLAIMS", "SCHEMA", "Sources", "claims_table", "write_claims"]
SCHEMA = "claims.schema.yaml"
CLAIMS = datafiles.path("data/claims.yaml")  # the paper's claims, shipped with the package
# one check per ``kind`` of claim (the schema's enum of kinds is this dict's keys)
CHECKS = {
    "memory": checks.memory_rows,
    "throughput": checks.throughput_rows,
    "lowest_memory": checks.lowest_memory_rows,
    "gap_grows": checks.gap_rows,
    "microbatch": projected.microbatch_rows,
    "competitive": projected.competitive_rows,
    "memory_ratio": projected.memory_ratio_rows,
    "crossover": checks.crossover_rows,
    "kv_cache": kv_cache_rows,
    "longest_context": longest_context_rows,
    "pipeline": projected.pipeline_rows,
    "experts": experts_rows,
}


def claims_table(path: Path = CLAIMS, src: Sources | None = None) -> pd.DataFrame:
    """Every claim of ``path`` against our numbers (one or more rows each); ConfigError (one
    line, naming the field) if the file does not follow its schema."""
    spec = read_yaml(path, "--claims")
    check_schema(spec, SCHEMA, f"--claims={str(path)!r}", strategies=names())
    src = src or Sources.find()
    cfg = get_config(spec["model"])
    rows: list[Row] = []
    for c in spec["claims"]:
        shared = {"subject": spec["subject"], "design_choice": spec.get("design_choice")}
        rows += CHECKS[c["kind"]]({**c, **shared}, cfg, src)
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
