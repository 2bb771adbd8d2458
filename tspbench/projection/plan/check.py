"""The planner's check (docs/planning.md quotes it): ``check`` compares the analytic memory
model and the planner's picks with measured cells (repeated runs of one sweep) and with the
fake-tensor estimator's projected cells, and writes check.md. Split from the maps: it reads
measurements, the maps only project.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from tspbench.core.config import ConfigError, load_model
from tspbench.projection import analytic, costmodel, stages
from tspbench.projection.costcheck import measured_runs
from tspbench.projection.plan import search
from tspbench.projection.plan.cache import OpsCache, cache_dir
from tspbench.projection.plan.types import Candidate, Config
from tspbench.runtime.registry import searched
from tspbench.runtime.spec import RunSpec

GiB = 2**30


def _norm(label: object) -> str:
    """A strategy label as any table spells it: ``tpsp (2x4)``, ``tpsp 2x4`` -> ``tpsp2x4``."""
    return re.sub(r"[^a-z0-9_]", "", str(label).lower())


def spearman(a, b) -> float:
    """Spearman's rank correlation: Pearson's of average ranks (pandas; no scipy needed)."""
    import pandas as pd

    ra, rb = pd.Series(list(a)).rank(), pd.Series(list(b)).rank()
    return float(ra.corr(rb))


def check(
    summaries: list[str],
    hardware: str,
    memory_csv: str,
    memory_hardware: str = "mi300x",
    cache: str | None = None,
) -> str:
    """The planner against what was measured and estimated (docs/planning.md quotes it):
    1. measured cells: does the analytic peak rank them as the measured peak does (Spearman)?
    2. per question (S, GPUs, mode, global batch): is the planner's pick within the measured
       run-to-run range of the measured best?
    3. projected 7B cells: does the analytic model agree with the estimator on what fits?"""
    for p in [*summaries, memory_csv]:
        if not Path(p).is_file():
            raise ConfigError(f"{p}: no such file")
    preset = costmodel.load_preset(hardware)
    runs, cells = measured_runs(summaries)
    ops = OpsCache(cache_dir(cache))
    lines = ["# The planner against measured and estimated cells (PROJECTED vs measured)", ""]
    recs = _memory_records(runs, cells)
    lines += _memory_ranks(recs, summaries)
    lines += _best_picks(recs, runs, ops, preset)
    lines += _fits(memory_csv, memory_hardware)
    return "\n".join(lines)


def _memory_records(runs: list, cells: list) -> list[dict]:
    """Per measured cell (its first run's row): the spec, the measured steady-state and
    first-step peaks and the analytic ones."""
    recs = []
    for cell in cells:
        row = runs[0].loc[cell].to_dict()
        spec = costmodel.case_of_row(row)
        mem = stages.memory(spec)[1] if spec.layout.pp > 1 else analytic.memory(spec)
        recs.append({"cell": cell, "spec": spec, "measured": float(row["peak_mem_bytes"]),
                     "measured_first": float(row["peak_mem_bytes_first_step"]),
                     "first": float(mem["peak_first"]), "steady": float(mem["peak"])})  # fmt: skip
    return recs


def _memory_ranks(recs: list[dict], summaries: list[str]) -> list[str]:
    """Section 1: does the analytic peak rank the measured cells as the measured peak does?"""
    import pandas as pd

    m = pd.DataFrame(recs)
    # each analytic peak against the same step's measured one: a record's peak_mem_bytes is the
    # steady state (AdamW's moments alive), peak_mem_bytes_first_step the first step's
    rho_first = spearman(m["first"], m["measured_first"])
    rho_steady = spearman(m["steady"], m["measured"])
    err_first = (m["first"] / m["measured_first"] - 1).abs()
    err_steady = (m["steady"] / m["measured"] - 1).abs()
    return [
        f"## 1. Memory ranks: {len(m)} measured cells ({', '.join(summaries[:1])})",
        "",
        f"Spearman rank correlation of the analytic peak with the measured peak of the same "
        f"step: {rho_steady:.4f} (steady state, what the planner checks against the cap), "
        f"{rho_first:.4f} (first step). |analytic/measured - 1|: steady state median "
        f"{err_steady.median():.1%}, max {err_steady.max():.1%}; first step median "
        f"{err_first.median():.1%}, max {err_first.max():.1%}.",
        "",
    ]


def _question(spec: RunSpec) -> tuple:
    """The question a cell answers: (S, ranks, mode, global batch)."""
    return (spec.seq_len, spec.layout.world_size, spec.mode, spec.batch * spec.layout.dp)


def _best_picks(recs: list[dict], runs: list, ops: OpsCache, preset: dict) -> list[str]:
    """Section 2: per question with two cells or more, is the planner's pick the measured best
    or within its run-to-run range?"""
    questions: dict[tuple, list] = {}
    for rec in recs:
        questions.setdefault(_question(rec["spec"]), []).append(rec)
    table = []
    ok = 0
    for key, members in sorted(questions.items()):
        if len(members) < 2:
            continue
        row, within = _best_pick_row(key, members, runs, ops, preset)
        ok += within
        table.append(row)
    return [
        f"## 2. Best pick per question: {len(table)} questions (cells with the same S, ranks, "
        f"mode and global batch), preset {preset['name']}",
        "",
        "Step time: median of the runs [min, max]; within noise: the pick's range reaches the "
        "measured best's.",
        "",
        "| question | cells | planner's pick | measured best | pick s | best s | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *table,
        "",
        f"Pick is the measured best or within its run-to-run range in {ok} of {len(table)}.",
        "",
    ]


def _best_pick_row(
    key: tuple, members: list[dict], runs: list, ops: OpsCache, preset: dict
) -> tuple[str, bool]:
    """One question's table row (the planner's pick among its measured cells against the
    measured best), and whether the pick is within the best's run-to-run range."""
    configs = []
    for rec in members:
        spec = rec["spec"]
        opts = {k: spec.options[k] for k in searched() if k in spec.options}
        cand = Candidate(spec.strategy, spec.layout, spec.batch, spec.recompute, opts,
                         spec=spec, peak=rec["steady"], fits=True)  # fmt: skip
        conf = Config(spec.strategy, spec.layout, spec.recompute, opts, candidates=[cand])
        search.count_config(conf, ops, preset)
        configs.append((conf, rec["cell"]))
    ranked = search.rank([c for c, _ in configs])
    pick = next(cell for c, cell in configs if c is ranked[0].config)

    def times(cell: str) -> list[float]:
        return sorted(float(r.loc[cell, "step_time_s"]) for r in runs)

    measured = {cell: statistics.median(times(cell)) for _, cell in configs}
    best = min(measured, key=lambda cell: measured[cell])
    tp, tb = times(pick), times(best)
    within = tp[0] <= tb[-1]  # the ranges overlap: indistinguishable on this machine
    S, world, mode, gb = key
    row = (
        f"| S={S} {mode} {world} ranks B={gb} | {len(members)} | {pick} | {best} | "
        f"{measured[pick]:.3f} [{tp[0]:.3f}, {tp[-1]:.3f}] | "
        f"{measured[best]:.3f} [{tb[0]:.3f}, {tb[-1]:.3f}] | "
        f"{'same' if pick == best else ('within noise' if within else 'NO')} |"
    )
    return row, within


def _fits(memory_csv: str, memory_hardware: str) -> list[str]:
    """Section 3: do the analytic model and the fake-tensor estimator agree on which projected
    cells fit (the cells' specs from the estimate records beside ``memory_csv``)?"""
    import pandas as pd

    mem = pd.read_csv(memory_csv)
    cap = costmodel.usable_memory(costmodel.load_preset(memory_hardware))
    specs = _estimate_specs(Path(memory_csv).parent / "estimates")
    agree, rows = 0, []
    for _, r in mem.iterrows():
        key = (_norm(r["strategy"]), int(r["seq_len"]), str(r["recompute"]))
        if key not in specs:
            raise ConfigError(f"{memory_csv}: no estimate record for {key} beside it")
        peak = float(analytic.memory(specs[key])["peak"])
        same = (peak <= cap) == bool(r["fits"])
        agree += same
        if not same:
            rows.append(f"{r['strategy']} {r['recompute']} S={int(r['seq_len'])}: analytic "
                        f"{peak / GiB:.1f} GiB, estimate {r['peak_gib']:.1f} GiB")  # fmt: skip
    margin = (mem["analytic_gib"] - mem["peak_gib"]).abs()
    return [
        f"## 3. Fits, against the fake-tensor estimator: {memory_csv}",
        "",
        f"Cap {cap / GiB:.0f} GiB ({memory_hardware}): the analytic model and the estimator agree "
        f"on which cells fit in {agree} of {len(mem)}"
        + (f"; they disagree on {', '.join(rows)}" if rows else "")
        + f". |analytic - estimate| median {margin.median():.2f} GiB, max {margin.max():.1f} GiB.",
        "",
    ]


def _estimate_specs(folder: Path) -> dict[tuple, RunSpec]:
    """The specs of the estimate records in ``folder``, by (label, S, recompute)."""
    specs = {}
    for f in sorted(folder.glob("*.json")):
        e = json.loads(f.read_text())
        spec = RunSpec.make(
            e["strategy"], load_model(e["model"])[0], degree=e["degree"], tp=e["tp"], sp=e["sp"],
            dp=e["dp"], seq_len=e["seq_len"], batch=e["batch"], mode=e["mode"], dtype=e["dtype"],
            recompute=e["recompute"],
        )  # fmt: skip
        specs[(_norm(spec.label), spec.seq_len, spec.recompute)] = spec
    return specs
