"""``tspbench plan``: which strategy, degrees, micro-batch and recomputation to run a model with.

Every strategy of the registry is asked for its model groups (``sweep_layouts``) at every degree
D that divides the GPUs and fits a node (``max_degree``; TP+SP at every T x Sigma of D), data
parallelism fills the rest (dp = G / D); each group is tried with every micro-batch (1..16, or
the one that gives ``global_batch`` = B x dp), recomputation none and full, and every value of
each option the strategy declares ``searched`` (``Strategy.searched_values``: TSP's MLP schedules
ring and broadcast, and every KV bucket that splits a head group's KV heads).
:class:`RunSpec` validates each candidate (a rule it breaks is the candidate's binding
constraint); the analytic model (:func:`tspbench.projection.analytic.memory`, steady state)
decides whether it fits the memory cap; the cost model
(:func:`tspbench.projection.costmodel.project`) projects step time, tokens/s and MFU. A D=1
group of every multi-rank strategy is the single-device model: only ``single`` stands for it.

Serving (``--mode decode`` or ``generate``, ``docs/decode.md``): the strategies with a decode
path, each model group a run of its own (dp = 1) and the G / D groups serving apart, each its
own batch; memory is the decode model's (the prefill with its cache, or a decode step) and the
projection :func:`tspbench.projection.decode.project_decode`'s, tokens/s the generated tokens
of all groups. Decode steps are charged no dispatch, so ``decode`` counts nothing; ``generate``
counts its prefill's operations.

Dispatch time needs the operations the real code issues (counted on fake tensors: seconds per
configuration), which depend on the strategy, its group, recomputation, options, mode, dtype
and heads, never on S, the micro-batch or dp, so each configuration is counted once
and kept on disk (``~/.cache/tspbench``, keyed by its shrunk copy and a digest of the step's
source code). A plan counts only what can change its answer: every configuration is first
projected without dispatch (an upper bound on its tokens/s), then counted in the order of the
bounds until none left uncounted could enter the top rows or beat a strategy's best (branch and
bound): every fitting row shown is exact, the rest are marked as bounds.
An option declared ``bounded_by_default`` (TSP's KV bucket: it repeats its group's gathers and
kernel calls and removes none) is bounded by its counted twin at the default (:func:`tighten`);
priced as the twin otherwise, it is counted only with ``--exact`` or an estimate.

This module enumerates and ranks; the records it fills are in :mod:`.types`, the caches in
:mod:`.cache`, the printed answer in :mod:`.render` and the commands in :mod:`.launch`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time

from tspbench.core.config import ConfigError
from tspbench.core.options import Value, only_where_used
from tspbench.core.strategy import Layout, Strategy
from tspbench.projection import analytic, costmodel, decode, stages
from tspbench.projection.plan.cache import OpsCache, cache_dir, estimate_peak
from tspbench.projection.plan.types import (
    MAX_BATCH,
    Candidate,
    Config,
    Plan,
    Request,
    Row,
    divisors,
)
from tspbench.runtime.pipelined import equal_rounds, stages_per_rank
from tspbench.runtime.registry import planned, searched
from tspbench.runtime.spec import RunSpec

GiB = 2**30


# -- what is tried --------------------------------------------------------------------------------
def one_rank_only(impl: type[Strategy]) -> bool:
    """A strategy whose model group is always one rank (``single``)."""
    return all(lay.degree == 1 for lay in impl.sweep_layouts([2], [[2, 1], [1, 2]]))


def _spec(
    req: Request,
    strategy: str,
    lay: Layout,
    batch: int,
    rc: str,
    options: dict[str, Value],
    schedule: str = "1f1b",
    microbatches: int = 0,
) -> RunSpec:
    """A candidate's run. A decode run is one model group: its dp copies serve apart, each its
    own batch."""
    if req.new_tokens:
        lay = dataclasses.replace(lay, dp=1)
    return RunSpec(
        strategy=strategy, cfg=req.cfg, layout=lay, seq_len=req.seq_len, batch=batch,
        mode=req.mode, new_tokens=req.new_tokens, dtype=req.dtype, recompute=rc,
        options=options, quiet=True, pp_schedule=schedule, microbatches=microbatches,
    )  # fmt: skip


def option_sets(
    req: Request, impl: type[Strategy], base: RunSpec | None, pp: int = 1
) -> list[dict]:
    """Every combination of the strategy's searched options (the plan's order: the first varies
    slowest), each restricted to the values the request names (none of them: its default); an
    option that matters only under another's value (``only_with``) takes its default elsewhere,
    so no combination repeats a run; one that matters only in a pipeline is left out where
    ``pp`` is 1 (the run's default, which it cannot change: no column, no flag)."""
    offered = impl.searched_values(base)
    axes = []
    for name in (k for k in searched() if k in offered):
        o = next(o for o in impl.options if o.name == name)
        if not o.applies(pp, req.cfg.moe):
            continue
        asked = req.options.get(name)
        values = [v for v in offered[name] if asked is None or v in asked]
        axes.append([(name, v) for v in values or [o.default]])
    return only_where_used(impl.options, [dict(c) for c in itertools.product(*axes)])


def peak_of(spec: RunSpec) -> float:
    """Peak bytes per GPU in closed form: the steady training step, the forward pass, or a
    generation (its prefill with the cache, or a decode step: docs/decode.md); a pipeline's
    fullest stage (:func:`stages.memory`)."""
    if spec.layout.pp > 1:
        return float(stages.memory(spec)[1]["peak"])
    return float((decode.memory if spec.decoding else analytic.memory)(spec)["peak"])


def project_of(spec: RunSpec, preset: dict, dp: int, ops: int | None) -> dict:
    """The cost model's projection; for a decode run (``ops``: its prefill's operations), the
    step is a decode step (``decode``: latency per token) or a generation (``generate``), and
    tokens/s counts the tokens that ``dp`` independent copies generate."""
    if not spec.decoding:
        return costmodel.project(spec, preset, ops=ops)
    r = decode.project_decode(spec, preset, prefill_ops=ops)
    one = spec.mode == "decode"
    step = r["decode_latency_s"] if one else r["generate_time_s"]
    made = spec.batch * (1 if one else spec.new_tokens)
    return r | {"step_time_s": step, "tokens_per_s": dp * made / step, "mfu": None}


def ops_spec(spec: RunSpec) -> RunSpec:
    """The run whose operations the projection charges: a decode run's prefill (decode steps
    are charged no dispatch: docs/decode.md); a pipeline's: one stage's on one micro-batch,
    which the projection charges once per micro-batch."""
    if spec.layout.pp > 1:
        return stages.micro_spec(spec)
    return decode.prefill_spec(spec) if spec.decoding else spec


def _batches(req: Request, lay: Layout) -> list[int] | str:
    """Micro-batches to try for a group (or why none: the global batch does not split)."""
    if req.global_batch is None:
        return list(range(1, req.max_batch + 1))
    if req.global_batch % lay.dp:
        return f"--global-batch={req.global_batch}: not divisible by dp={lay.dp} (G/D)"
    b = req.global_batch // lay.dp
    return [b] if b <= MAX_BATCH else f"micro-batch {b} (global batch / dp): above {MAX_BATCH}"


def enumerate_configs(req: Request) -> tuple[list[Config], list[dict]]:
    """Every configuration with its candidates (valid or not), and the degrees left out."""
    degrees = [d for d in divisors(req.gpus) if d <= req.max_degree]
    factors = [[t, d // t] for d in degrees for t in divisors(d)]
    configs = []
    for name, impl in planned().items():
        single = one_rank_only(impl)
        for lay in impl.sweep_layouts(degrees, factors):
            if lay.degree == 1 and not single:
                continue  # the single-device model: the one-rank strategy stands for it
            for pp in _pipelines(req, impl, lay.degree):
                staged = dataclasses.replace(lay, dp=req.gpus // (lay.degree * pp), pp=pp)
                # (forward only, GPipe and 1F1B run the same schedule: one of them; the
                # interleaved one trains only: alone, its candidates say so)
                one = [s for s in req.pp_schedules if stages_per_rank(s) == 1][:1]
                tried = req.pp_schedules if req.mode == "train" else one or req.pp_schedules[:1]
                for schedule in tried if pp > 1 else ("1f1b",):
                    configs += _layout_configs(req, name, impl, staged, schedule)
    return configs, _skipped_degrees(req)


def _pipelines(req: Request, impl: type[Strategy], degree: int) -> list[int]:
    """Pipeline sizes to try with a model group of ``degree``: 1, and for a strategy that runs
    as stages in a mode that pipelines (train, infer), every pp that divides the layers and
    G / D (or those the request names: one that does not divide the layers is tried, and
    refused by the run's own rule)."""
    rest = req.gpus // degree
    if not impl.stages or req.mode not in ("train", "infer"):
        return [1] if not req.pp or 1 in req.pp else []
    if req.pp:
        return [p for p in req.pp if rest % p == 0]
    return [p for p in divisors(rest) if p == 1 or req.cfg.layers % p == 0]


def _microbatches(lay: Layout, batch: int, schedule: str) -> list[int]:
    """Micro-batch counts to try for a replica's batch: none without a pipeline (0); else every
    divisor of the batch from pp up (fewer leave 1F1B a stage with none in flight and GPipe
    more bubble) that the schedule takes (interleaved 1F1B: equal rounds, torch's rule); none
    where no such divisor exists (the table's footnote says so)."""
    if lay.pp == 1:
        return [0]
    ms = [m for m in divisors(batch) if m >= lay.pp]
    return [m for m in ms if equal_rounds(lay.pp, m)] if stages_per_rank(schedule) > 1 else ms


def _layout_configs(
    req: Request, name: str, impl: type[Strategy], lay: Layout, schedule: str = "1f1b"
) -> list[Config]:
    """The configurations of one layout (each recompute and option set), each with a candidate
    per micro-batch and micro-batch count (or one that says why the global batch does not
    split)."""
    batches = _batches(req, lay)
    base = None
    if not isinstance(batches, str):
        try:
            base = _spec(req, name, dataclasses.replace(lay, pp=1), impl.replica_batch(lay),
                         "none", {})  # fmt: skip
        except ConfigError:
            pass
    configs = []
    tries = [(rc, o) for rc in req.recompute for o in option_sets(req, impl, base, lay.pp)]
    for rc, opts in tries:
        conf = Config(name, lay, rc, opts, pp_schedule=schedule)
        if isinstance(batches, str):
            conf.candidates.append(Candidate(name, lay, 0, rc, opts, reason=batches))
        for b in [] if isinstance(batches, str) else batches:
            for m in _microbatches(lay, b, schedule):
                cand = Candidate(name, lay, b, rc, opts, microbatches=m,
                                 pp_schedule=conf.pipeline[1])  # fmt: skip
                try:
                    cand.spec = _spec(req, name, lay, b, rc, opts, schedule, m)
                except ConfigError as e:
                    cand.reason = str(e)
                conf.candidates.append(cand)
        configs.append(conf)
    return configs


def _skipped_degrees(req: Request) -> list[dict]:
    """The model groups above ``req.max_degree``: each strategy's layouts of them, with the rule
    that would refuse them anyway (None: none)."""
    skipped = []
    for d in divisors(req.gpus):
        if d <= req.max_degree:
            continue
        for name, impl in planned().items():
            for lay in impl.sweep_layouts([d], [[t, d // t] for t in divisors(d)]):
                if lay.degree != d:  # a one-rank strategy's group
                    continue
                lay = dataclasses.replace(lay, dp=req.gpus // d)
                try:
                    _spec(req, name, lay, impl.replica_batch(lay), "none", {})
                    why = None
                except ConfigError as e:
                    why = str(e)
                skipped.append({"strategy": name, "label": impl.label(lay), "degree": d,
                                "tp": lay.tp, "sp": lay.sp, "rule": why})  # fmt: skip
    return skipped


# -- deciding -------------------------------------------------------------------------------------
def charged(c: Candidate, preset: dict, ops: int) -> dict:
    """``c``'s projection with ``ops`` operations: its bound recharged (projected again for a
    decode run, which charges them otherwise, or a candidate without a bound)."""
    if c.run.decoding or c.bound is None:
        return project_of(c.run, preset, c.layout.dp, ops)
    return costmodel.recharge(c.bound, ops)


def count_config(conf: Config, ops: OpsCache, preset: dict) -> None:
    conf.ops = ops.get(ops_spec(conf.valid[0].run))
    for c in conf.valid:
        c.proj = charged(c, preset, conf.ops)


def tighten(configs: list[Config], preset: dict) -> None:
    """Bound every uncounted bounded configuration (a KV bucket) by its counted twin's
    operations (it dispatches at least as many: module docstring), so that it ranks no higher
    than the twin."""
    counted = {c.twin: c.ops for c in configs if not c.bounded and c.ops is not None}
    for conf in configs:
        ops = counted.get(conf.twin)
        if conf.bounded and conf.ops is None and ops is not None and conf.bound_ops != ops:
            conf.bound_ops = ops
            for c in conf.valid:
                c.bound = charged(c, preset, ops)


def rank(configs: list[Config]) -> list[Row]:
    """Fitting rows by tokens/s (an exact row before a bound of the same value), then the rest
    by peak memory."""
    rows = [Row(conf, best) for conf in configs if (best := conf.best()) is not None]
    fit = sorted((r for r in rows if r.fits), key=lambda r: (-r.cand.speed, not r.cand.exact))
    over = sorted((r for r in rows if not r.fits), key=lambda r: r.cand.peak_bytes)
    return fit + over


def _same_group(a: Row, b: Row) -> bool:
    la, lb = a.config.layout, b.config.layout
    return a.config.strategy == b.config.strategy and (la.degree, la.tp, la.sp) == (
        lb.degree, lb.tp, lb.sp) and a.config.pipeline == b.config.pipeline  # fmt: skip


def select(rows: list[Row], top: int) -> tuple[list[Row], int]:
    """The rows the table shows: the best ``top`` (a fitting row of the same group as a better
    one that needs no more memory is dominated and left out), then the best row of every
    strategy not shown yet; and how many were left out as dominated."""
    shown: list[Row] = []
    hidden = 0
    for r in rows:
        if r.fits and any(
            s.fits and _same_group(s, r) and s.cand.peak_bytes <= r.cand.peak_bytes for s in shown
        ):
            hidden += 1
            continue
        if len(shown) < top:
            shown.append(r)
    have = {r.config.strategy for r in shown}
    for r in rows:
        if r.config.strategy not in have:
            shown.append(r)
            have.add(r.config.strategy)
    return shown, hidden


def plan(
    req: Request,
    *,
    top: int = 10,
    exact: bool = False,
    estimate: int = 0,
    kernel: str = "fused",
    cache: str | os.PathLike | None = None,
    use_cache: bool = True,
    ops: OpsCache | None = None,
) -> Plan:
    """Enumerate, check and rank (module docstring); ``estimate``: re-check that many of the
    best rows with the fake-tensor estimator (a row over the cap is demoted, the next checked)."""
    t0 = time.perf_counter()
    root = cache_dir(cache) if use_cache else None
    configs, skipped = enumerate_configs(req)
    t1 = time.perf_counter()
    for conf in configs:
        for c in conf.valid:
            c.peak = peak_of(c.run)
            c.fits = c.peak <= req.memory_cap
            c.bound = project_of(c.run, req.hardware, c.layout.dp, 0)
            if req.mode == "decode":  # no dispatch charged: the bound is the projection
                c.proj = c.bound
    t2 = time.perf_counter()
    ops = ops or OpsCache(root)
    if exact:
        for conf in configs:
            if conf.valid:
                count_config(conf, ops, req.hardware)
    rows, shown, hidden = settle(configs, top, ops, req.hardware)
    t3 = time.perf_counter()
    checked: list[Candidate] = []
    if estimate:
        checked = _estimate(req, configs, estimate, kernel, root)
        rows, shown, hidden = settle(configs, top, ops, req.hardware)
    t4 = time.perf_counter()
    timings = {"enumerate_s": t1 - t0, "models_s": t2 - t1, "ops_s": t3 - t2,
               "estimate_s": t4 - t3, "total_s": t4 - t0}  # fmt: skip
    return Plan(req, configs, rows, shown, hidden, skipped, ops, timings, checked)


def settle(configs: list[Config], top: int, ops: OpsCache, preset: dict):
    """Rank, and count the operations of every fitting row shown until what is shown no longer
    changes: an uncounted row ranks by its bound, above its exact value, so once every shown
    row is exact, none left out can beat them."""
    while True:
        tighten(configs, preset)
        rows = rank(configs)
        shown, hidden = select(rows, top)
        todo = [r.config for r in shown if r.fits and not r.cand.exact]
        if not todo:
            return rows, shown, hidden
        for conf in todo:
            count_config(conf, ops, preset)


def _estimate(req, configs, n, kernel, root) -> list[Candidate]:
    """Re-check the best fitting rows with the estimator until ``n`` fit (at most 3n tries): a
    micro-batch over the cap is demoted, and its group's next best micro-batch competes."""
    checked: list[Candidate] = []
    while sum(c.fits for c in checked) < n and len(checked) < 3 * n:
        nxt = next((r for r in rank(configs) if r.fits and r.cand.estimate is None), None)
        if nxt is None:
            break
        c = nxt.cand
        c.estimate = estimate_peak(c.run, root, kernel)
        c.peak, c.peak_source = float(c.estimate["peak_mem_bytes"]), f"estimate ({kernel})"
        c.fits = c.peak <= req.memory_cap
        checked.append(c)
    return checked


def limit(row: Row, req: Request) -> str:
    """What stops the row from going faster: memory, a rule, or the batch range."""
    c = row.cand
    if not c.fits:
        return f"memory: {c.peak_bytes / GiB:.1f} > {req.memory_cap / GiB:.1f} GiB"
    if req.global_batch is not None:
        return "global batch"
    bigger = [x for x in row.config.valid if x.batch > c.batch]
    if not bigger:
        return f"max batch {req.max_batch}"
    b = min(x.batch for x in bigger)  # (a pipeline's every micro-batch count of it)
    nxt = min((x for x in bigger if x.batch == b), key=lambda x: x.peak_bytes)
    if not nxt.fits:
        return f"memory at B={nxt.batch} ({nxt.peak_bytes / GiB:.1f} GiB)"
    return "throughput (a larger batch fits but projects less)"


def binding(c: Candidate, req: Request) -> str | None:
    """The constraint a candidate breaks: a validation rule, memory, or none."""
    if c.spec is None:
        return c.reason
    return None if c.fits else "memory"


def _counted(conf: Config) -> int:
    assert conf.ops is not None, "a row with a projection has its operations counted"
    return conf.ops


def contest(plan: Plan) -> dict | None:
    """The best plan against the best plan of each other strategy, at the preset's nominal
    rates and at every corner of their stated ranges (``rate_ranges``;
    :func:`costmodel.ratio_ranges`: the fastest rival at each corner): a **tie** where another
    strategy is as fast at some corner. Both see the same rates, so the ratio moves far less
    than either step time. None: no rival fits, or a serving plan."""
    best = plan.best
    if best is None or best.cand.run.decoding or best.cand.proj is None:
        return None
    rivals: dict[str, Row] = {}
    for r in plan.rows:  # ranked: each other strategy's first fitting, counted row
        name = r.cand.strategy
        if r.fits and r.cand.proj is not None and name != best.cand.strategy:
            rivals.setdefault(name, r)
    if not rivals:
        return None
    first = next(iter(rivals.values()))
    # (the counted operations: a pipeline's are one stage's on one micro-batch, as counted)
    mine = (best.cand.run, _counted(best.config))
    theirs = [(r.cand.run, _counted(r.config)) for r in rivals.values() if r.cand.proj]
    lo, hi = costmodel.ratio_ranges([mine, *theirs], plan.request.hardware)[0]
    margin = best.cand.speed / first.cand.speed
    return {
        "rival": first.config.label,
        "margin": margin - 1,
        "margin_range": [min(lo, margin) - 1, max(hi, margin) - 1],
        "tie": min(lo, margin) <= 1,
    }
