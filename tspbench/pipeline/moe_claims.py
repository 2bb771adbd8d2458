"""The paper's claim that TSP composes with expert parallelism, against ours, for
``tspbench claims``: judged on the measured summary's cells of a model with experts (role
``moe``: the default sweep's ``moe`` cell set) by equality (every strategy's loss and gradient
norm on the same cell; the tests check every gradient against the reference) and by the peak
memory per rank of the subject's leanest expert schedule against each strategy that runs the
experts by expert parallelism (TP + EP, FSDP+CP + EP). Not projected: the closed forms price
the experts' bytes and parameters but not yet their memory, and the estimator and the cost
model have no experts (issue 33); the row says so.
"""

from __future__ import annotations

import pandas as pd

from tspbench.core.config import ModelConfig
from tspbench.pipeline.aggregate import per_sweep
from tspbench.pipeline.claim_checks import Row, Sources, _rel
from tspbench.runtime.registry import get_strategy

__all__ = ["experts_rows", "measured_experts"]
EQUAL = 1e-5  # relative: a strategy's loss and gradient norm against another's on one cell


def measured_experts(src: Sources) -> pd.DataFrame:
    """The ok training cells of the measured summary's sweeps with experts (none: empty)."""
    try:
        df = per_sweep(pd.read_csv(src.measured))
    except (OSError, ValueError):
        return pd.DataFrame()
    if "role" not in df:
        return pd.DataFrame()
    rows = df[(df["role"] == "moe") & (df["mode"] == "train") & (df["status"] == "ok")]
    return rows.drop_duplicates("cell")


def _equal(g: pd.DataFrame) -> bool:
    """Every row's loss and gradient norm within EQUAL of the first's."""
    first = g.iloc[0]
    return all(
        abs(r[k] / first[k] - 1) <= EQUAL for _, r in g.iterrows() for k in ("loss", "grad_norm")
    )


def experts_rows(c: dict, cfg: ModelConfig, src: Sources) -> list[Row]:
    """One row: on each (experts, length, D) cell set, equality of every strategy, and the
    subject's leanest peak per rank over each rival's (``strategies``), below 1: leaner."""
    subject, rivals = c["subject"], c["strategies"]
    d = measured_experts(src)
    shown, equal, leaner = [], True, True
    for (E, S, D), g in d.groupby(["experts", "seq_len", "degree"]) if len(d) else []:
        same = _equal(g)
        equal &= same
        mine = g[g["strategy"] == subject]
        if mine.empty:
            continue
        lean = mine.loc[mine["peak_mem_bytes"].idxmin()]
        parts = []
        for rival in rivals:
            theirs = g[g["strategy"] == rival]
            if theirs.empty:
                continue
            ratio = lean["peak_mem_bytes"] / theirs["peak_mem_bytes"].min()
            leaner &= ratio < 1
            parts.append(f"/ {get_strategy(rival).display} {ratio:.2f}")
        shown.append(
            f"E={E} S={S} D={D}: {len(g)} runs {'equal' if same else 'NOT equal'} "
            f"(loss {g['loss'].iloc[0]:.6f}); {lean['label']} "
            f"{lean['peak_mem_bytes'] / 2**20:.2f} MiB/rank " + ", ".join(parts)
        )
    if not shown:
        ours = "measured: no cell with experts in this summary (snakemake runs the moe cell set)"
        judged = "not checkable here"
    else:
        ours = (
            f"measured (CPU, {len(d)} cells with experts; peak per rank of {subject}'s leanest "
            "expert schedule / each rival's): " + "; ".join(shown) + "; not projected (no "
            "memory closed form, estimator or cost model for experts yet)"
        )
        judged = "differs" if not equal else "partly" if leaner else "differs"
    return [
        Row(
            c["claim"],
            "composes with expert parallelism for mixture-of-experts models",
            ours,
            judged,
            "composition judged by equality (every strategy on the same cell; the tests check "
            "each against the reference) and by the subject's memory per rank against expert "
            "parallelism's compositions (Megatron-Core's TP + EP, torchtitan's FSDP+CP + EP); "
            "partly at best until the projection covers experts: a CPU sweep of a tiny model "
            "says nothing of a published MoE's size",
            c["source"],
            _rel(src.measured),
        )
    ]
