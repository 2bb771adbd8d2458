"""The paper's claim that TSP composes with expert parallelism, against ours, for
``tspbench claims``: judged on the measured summary's cells of a model with experts (role
``moe``: the default sweep's ``moe`` cell set) by equality (every strategy's loss and gradient
norm on the same cell; the tests check every gradient against the reference) and by the peak
memory per rank of the subject's leanest expert schedule against each strategy that runs the
experts by expert parallelism (TP + EP, FSDP+CP + EP); and projected at a published MoE's
size (the row's ``model``, a committed config.json: Mixtral 8x7B) on the row's ``hardware``:
the closed-form peak per GPU of one sequence without recomputation, and the largest
micro-batch that fits the device's usable memory with it, under even routing (the closed
forms' assumption; within 1% of the fake-tensor estimate at that size).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from tspbench.core.config import ConfigError, ModelConfig, load_model
from tspbench.pipeline.aggregate import per_sweep
from tspbench.pipeline.claim_checks import GiB, Row, Sources, _rel
from tspbench.pipeline.claim_projected import largest_batch
from tspbench.projection import analytic
from tspbench.projection.costmodel import load_preset, usable_memory
from tspbench.runtime.registry import get_strategy
from tspbench.runtime.spec import RunSpec

ROOT = Path(__file__).resolve().parents[2]  # a row's model file is named from here

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


def _runs(strategy: str) -> list[dict]:
    """Each setting of ``strategy``'s expert options (TSP's schedules; none: one run)."""
    opts = [o for o in get_strategy(strategy).options if o.experts_only]
    return [{o.name: v} for o in opts for v in o.values()] or [{}]


def projected_experts(c: dict) -> tuple[str, bool]:
    """(what the projection says, whether the subject's leanest expert setting is leaner than
    every rival: a lower peak at one sequence and at least as large a micro-batch)."""
    name = c["model"]
    if "/" in name:  # a committed config.json: from here, else from the checkout's root
        found = [p for p in (Path(name), ROOT / name) if p.is_file()]
        if not found:
            return f"not projected: {name} is not here (run from a checkout)", False
        name = str(found[0])
    try:
        cfg, _ = load_model(name)
    except ConfigError as e:
        return f"not projected: {e}", False
    budget = usable_memory(load_preset(c["hardware"]))
    D, S = c["degree"], c["seq_len"]

    def peak(s: str, opts: dict, B: int, rc: str) -> float:
        spec = RunSpec.make(s, cfg, degree=D, seq_len=S, dtype="bf16", batch=B, recompute=rc,
                            **opts)  # fmt: skip
        return analytic.memory(spec)["peak"]

    got: dict[str, tuple[float, int]] = {}  # label: (peak at B = 1, largest B with recompute)
    whose: dict[str, str] = {}
    for s in (c["subject"], *c["strategies"]):
        for opts in _runs(s):
            try:
                label = RunSpec.make(s, cfg, degree=D, seq_len=S, **opts).label
                one = peak(s, opts, 1, "none")
                fits = largest_batch(lambda B, s=s, o=opts: peak(s, o, B, "full"), budget, 64)
                got[label] = one, fits
                whose[label] = s
            except ConfigError:  # a group the model cannot split is no competitor
                continue
    mine = {k: v for k, v in got.items() if whose[k] == c["subject"]}
    rivals = {k: v for k, v in got.items() if k not in mine}
    if not mine or not rivals:
        return (
            f"not projected: no layout of D={D} runs {Path(c['model']).stem} for both sides",
            False,
        )
    lean = min(mine, key=lambda k: mine[k][0])
    leaner = all(got[lean][0] < p and got[lean][1] >= b for p, b in rivals.values())
    text = (
        f"projected ({Path(c['model']).stem}, S={S}, D={D}, bf16, {c['hardware']}'s usable "
        f"{budget / GiB:.1f} GiB, closed forms, even routing): peak per GPU at B=1 without "
        "recomputation / largest micro-batch with it: "
        + ", ".join(f"{k} {p / GiB:.1f} GiB / B={b}" for k, (p, b) in got.items())
        + f"; {lean} against each rival "
        + ", ".join(f"{got[lean][0] / p:.2f}" for p, _ in rivals.values())
    )
    return text, leaner


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
    projected, ahead = projected_experts(c)
    if not shown:
        ours = (
            "measured: no cell with experts in this summary (snakemake runs the moe cell set); "
            + projected
        )
        judged = "not checkable here"
    else:
        ours = (
            f"measured (CPU, {len(d)} cells with experts; peak per rank of {subject}'s leanest "
            "expert schedule / each rival's): " + "; ".join(shown) + "; " + projected
        )
        judged = (
            "differs" if not equal or not (leaner or ahead)
            else "holds" if leaner and ahead
            else "partly"
        )  # fmt: skip
    return [
        Row(
            c["claim"],
            "composes with expert parallelism for mixture-of-experts models",
            ours,
            judged,
            "composition judged by equality (every strategy on the same cell; the tests check "
            "each against the reference) and by the subject's memory per rank against expert "
            "parallelism's compositions (Megatron-Core's TP + EP, torchtitan's FSDP+CP + EP), "
            "measured on the CPU sweep and projected at a published MoE's size; holds where "
            "every strategy is equal and the subject is leaner in both, partly in one of them",
            c["source"],
            _rel(src.measured),
        )
    ]
