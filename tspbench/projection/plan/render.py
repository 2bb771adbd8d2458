"""What ``tspbench plan`` prints: the text answer (:func:`render`: header, ranked table, why
configurations are missing, the best plan's commands and config) and the JSON one
(:func:`to_json`). Split from the planner so that deciding and wording change apart.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from tspbench.core.config import ModelConfig
from tspbench.projection.costmodel import usable_memory
from tspbench.projection.plan.launch import pipeline_config, run_lines
from tspbench.projection.plan.search import binding, contest, limit
from tspbench.projection.plan.types import Candidate, Plan, Request, label, node_size
from tspbench.runtime.registry import searched, strategies

GiB = 2**30
STEP = {"train": "step s", "infer": "step s", "decode": "s/token", "generate": "gen s"}


def describe(cfg: ModelConfig) -> str:
    wide = f" of {cfg.d_head}" if cfg.head_dim else ""  # heads not h/heads wide (Qwen3 4B)
    return (
        f"h {cfg.hidden}, {cfg.layers} layers, {cfg.heads} heads{wide} / {cfg.kv_heads} KV, "
        f"f {cfg.ffn}, V {cfg.vocab}, {cfg.n_params() / 1e9:.2f}B parameters"
    )


def candidate_dict(c: Candidate, req: Request) -> dict[str, Any]:
    lay, r = c.layout, c.result or {}
    factors = strategies()[c.strategy].factors(lay)
    serving = {}
    if req.new_tokens:
        serving = {"new_tokens": req.new_tokens, "decode_latency_s": r.get("decode_latency_s"),
                   "kv_cache_bytes": r.get("kv_cache_bytes")}  # fmt: skip
    return {
        "strategy": c.strategy,
        "label": label(c.strategy, lay, c.pp_schedule),
        "degree": lay.degree,
        "tp": factors["tp"],
        "sp": factors["sp"],
        "dp": lay.dp,
        "pp": lay.pp,
        "pp_schedule": c.pp_schedule or None,
        "microbatches": c.microbatches or None,
        "gpus": lay.world_size,
        "batch": c.batch or None,  # None: no micro-batch splits the global batch
        "global_batch": c.batch * lay.dp or None,
        "seq_len": req.seq_len,
        "mode": req.mode,
        "dtype": req.dtype,
        "recompute": c.recompute,
        **{k: c.options.get(k) for k in searched()},  # None: the strategy has no such option
        **serving,
        "fits": bool(c.fits),
        "peak_mem_bytes": c.peak,
        "memory_source": c.peak_source if c.peak is not None else None,
        "memory_cap_bytes": req.memory_cap,
        "headroom_bytes": None if c.peak is None else req.memory_cap - c.peak,
        "tokens_per_s": r.get("tokens_per_s"),
        "tokens_per_s_per_gpu": r["tokens_per_s"] / req.gpus if r else None,
        "step_time_s": r.get("step_time_s"),
        "mfu": r.get("mfu"),
        "throughput_exact": c.exact,  # False: no dispatch time yet, an upper bound
        "binding": binding(c, req),
    }


def to_json(plan: Plan) -> dict[str, Any]:
    req, best = plan.request, plan.best
    out: dict[str, Any] = {
        "projected": True,
        "request": {
            "model": req.model,
            "model_config": dataclasses.asdict(req.cfg),
            "hardware": req.hardware.get("name"),
            "seq_len": req.seq_len,
            "gpus": req.gpus,
            "global_batch": req.global_batch,
            "mode": req.mode,
            "new_tokens": req.new_tokens,
            "dtype": req.dtype,
            "memory_cap_bytes": req.memory_cap,
            "max_degree": req.max_degree,
            "notes": list(req.notes),
        },
        "candidates": [candidate_dict(c, req) for c in plan.candidates],
        "ranked": [candidate_dict(r.cand, req) | {"limit": limit(r, req)} for r in plan.shown],
        "best": None,
        "filtered": filtered_lines(plan),
        "skipped_degrees": plan.skipped,
        "ops": {
            "configurations": sum(1 for c in plan.configs if c.valid),
            "counted": plan.ops.counted,
            "cached": plan.ops.hits,
        },  # fmt: skip
        "timings": plan.timings,
    }
    if best is not None:
        out["best"] = candidate_dict(best.cand, req) | {
            "limit": limit(best, req),
            **run_lines(req, best.cand.run),
            "contest": contest(plan),
        }
    return out


def _contest_line(plan: Plan) -> list[str]:
    """The best plan's margin over the best other strategy, with its range (a tie if the
    order flips within the rates' stated ranges)."""
    got = contest(plan)
    if got is None:
        return []
    lo, hi = got["margin_range"]
    verdict = "a TIE within the rates' ranges" if got["tie"] else "ahead at every corner"
    return [f"  against {got['rival']}: {got['margin']:+.1%} projected, {lo:+.1%} to {hi:+.1%} "
            f"over every corner of the preset's rate_ranges (hardware.json), against the "
            f"fastest other strategy there: {verdict}"]  # fmt: skip


def filtered_lines(plan: Plan) -> list[str]:
    """Why configurations are missing: a rule per group (with the micro-batches it hits when
    it hits only some), and the degrees above ``max_degree``."""
    req = plan.request
    rules: dict[tuple, set[int]] = {}  # (label, D, rule with the batch as B) -> batches hit
    runnable: set[tuple] = set()  # (label, D) with some valid micro-batch
    for conf in plan.configs:
        for c in conf.candidates:
            if c.reason:
                why = re.sub(rf"\bbatch={c.batch}\b", "batch=B", c.reason)
                rules.setdefault((conf.label, conf.layout.degree, why), set()).add(c.batch)
            else:
                runnable.add((conf.label, conf.layout.degree))
    lines = []
    for (name, D, why), batches in rules.items():
        some = f" (B={_ranges(sorted(batches))})" if (name, D) in runnable else ""
        lines.append(f"{name} D={D}{some}: {why}")
    if any(conf.layout.pp > 1 for conf in plan.configs):
        lines.append("x PPn: each micro-batch B split into M micro-batches, every M from n up "
                     "that divides B; a B with none (B < n) is not tried")  # fmt: skip
    above = sorted({s["degree"] for s in plan.skipped})
    if above:
        lines.append(
            f"D={', '.join(map(str, above))}: above --max-degree {req.max_degree} "
            f"(GPUs per node: {node_size(req.hardware)}), not enumerated"
        )
        said: set[str] = set()
        for s in plan.skipped:  # the smallest such degree a rule refuses, per strategy
            if s["rule"] and s["strategy"] not in said:
                said.add(s["strategy"])
                lines.append(f"  and anyway {s['label']} D={s['degree']}: {s['rule']}")
    return lines


def _ranges(xs: list[int]) -> str:
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def _fmt_rate(c: Candidate) -> str:
    t = c.tokens_per_s
    return "-" if t is None else ("" if c.exact else "<=") + f"{t:,.0f}"


def _usable_note(req: Request, cap: float) -> str:
    """Where the cap comes from: the preset's usable memory (below what the device reports)."""
    u = req.hardware.get("usable_memory")
    if not u or abs(usable_memory(req.hardware) / GiB - cap) > 1e-9:
        return ""  # the user's own --memory-cap, or a calibrated preset's measured memory
    return f" (usable of {u['visible_bytes'] / GiB:.1f} GiB visible: context, collectives, " \
        "BLAS workspaces and allocator slack reserved)"  # fmt: skip


def render(plan: Plan, models: list[str] | None = None) -> str:
    """The text answer: header, ranked table, why others are missing, and the best plan's
    commands and pipeline config."""
    req = plan.request
    cap = req.memory_cap / GiB
    n_valid = sum(len(c.valid) for c in plan.configs)
    n_fit = sum(len(c.fitting) for c in plan.configs)
    n_conf = sum(1 for c in plan.configs if c.valid)
    batches = (f"global batch {req.global_batch}" if req.global_batch
               else f"micro-batch 1..{req.max_batch}")  # fmt: skip
    length = (f"prompt {req.seq_len}, {req.new_tokens} new tokens" if req.new_tokens
              else f"S={req.seq_len}")  # fmt: skip
    out = [
        f"PROJECTED plan: {req.model} ({describe(req.cfg)})",
        f"  {req.mode} {req.dtype}, {length}, {req.gpus} GPUs of {req.hardware.get('name')}"
        f" ({node_size(req.hardware)} per node, D <= {req.max_degree}), memory cap {cap:.1f} GiB"
        f"{_usable_note(req, cap)}, {batches}",
        f"  {len(plan.candidates)} candidates in {len(plan.configs)} configurations: {n_fit} fit, "
        f"{n_valid - n_fit} over memory, {len(plan.candidates) - n_valid} refused by a rule; "
        f"operations counted for {plan.ops.counted} configurations, {plan.ops.hits} cached, of "
        f"{n_conf}; {plan.timings['total_s']:.1f} s",
        *(f"  note: {n}" for n in req.notes),
        "",
    ]
    opts = searched()
    head = ["#", "strategy", "D", "dp", "B", "M", "recompute", *(o.short for o in opts.values()),
            "peak GiB", "headroom", "fits", "tokens/s", "tok/s/GPU", "MFU", STEP[req.mode],
            "limit"]  # fmt: skip
    table = []
    for i, r in enumerate(plan.shown, 1):
        c, res = r.cand, r.cand.result or {}
        src = "*" if c.peak_source != "analytic" else ""
        table.append([
            str(i), r.config.label, str(c.layout.degree), str(c.layout.dp), str(c.batch),
            str(c.microbatches or "-"), c.recompute, *(c.shown(k) for k in opts),
            f"{c.peak_bytes / GiB:.1f}{src}",
            f"{(req.memory_cap - c.peak_bytes) / GiB:.1f}", "yes" if c.fits else "NO", _fmt_rate(c),
            ("" if c.exact else "<=") + f"{res['tokens_per_s'] / req.gpus:,.0f}" if res else "-",
            f"{res['mfu']:.1%}" if res.get("mfu") is not None else "-",
            f"{res['step_time_s']:.3f}" if res else "-", limit(r, req),
        ])  # fmt: skip
    widths = [max(len(x) for x in col) for col in zip(head, *table)]
    n = 7 + len(opts)  # the columns before the peak; an int option's column is numbers
    right = {0, 2, 3, 4, 5, *(7 + i for i, o in enumerate(opts.values()) if not o.values())}
    right |= {n + k for k in (0, 1, 3, 4, 5, 6)}
    for line in [head, *table]:
        cells = [
            x.rjust(w) if k in right else x.ljust(w) for k, (x, w) in enumerate(zip(line, widths))
        ]
        out.append("  ".join(cells).rstrip())
    foot = "fitting rows by tokens/s, then the rest by peak memory"
    if plan.hidden:
        foot += f"; {plan.hidden} dominated rows not shown (same group: faster with less memory)"
    peak = "analytic steady state"
    if req.new_tokens:
        foot += ("; tokens/s: generated tokens of the dp model groups, each serving its own "
                 "batch")  # fmt: skip
        peak = "analytic, the larger of the prefill with its cache and a decode step"
    if any(r.config.layout.pp > 1 for r in plan.shown):
        foot += ("; x PPn: n pipeline stages (D x dp GPUs each) under the schedule named, "
                 "M micro-batches of B/M, peak: the fullest stage's")  # fmt: skip
    out.append(f"({foot}; <=: upper bound, the host's issue time not counted; peak: {peak}"
               + ("; *: fake-tensor estimate" if plan.estimated else "") + ")")  # fmt: skip
    for k, o in opts.items():
        if o.note and any(
            c.options.get(k, o.default) != o.default for c in plan.candidates if c.spec
        ):
            out.append(o.note)
    for c in plan.estimated:
        assert c.estimate is not None  # what it was estimated to need
        shown = " ".join(f"{o.short}={c.shown(k)}" for k, o in opts.items())
        out.append(
            f"estimator: {strategies()[c.strategy].label(c.layout)} D={c.layout.degree} "
            f"B={c.batch} {c.recompute} {shown}: "
            f"{c.peak_bytes / GiB:.1f} GiB, "
            f"{'fits' if c.fits else 'OVER the cap'} ({c.estimate['estimate_s']:.1f} s"
            f"{', cached' if c.estimate.get('cached') else ''})"
        )
    filt = filtered_lines(plan)
    if filt:
        out += ["", "filtered:", *(f"  {x}" for x in filt)]
    best = plan.best
    out.append("")
    if best is None:
        out.append(f"no candidate fits {cap:.1f} GiB per GPU: more GPUs per model group, "
                   "recomputation, a shorter sequence or a larger memory cap")  # fmt: skip
        return "\n".join(out)
    c = best.cand
    lines = run_lines(req, c.run)
    out += [
        f"best plan: {best.config.label} D={c.layout.degree} dp={c.layout.dp} B={c.batch} "
        + (f"M={c.microbatches} " if c.microbatches else "")
        + f"recompute={c.recompute}"
        + "".join(f" {k}={searched()[k].text(v)}" for k, v in c.options.items())
        + ": "
        f"{c.peak_bytes / GiB:.1f} GiB per GPU ({c.peak_source}, headroom "
        f"{(req.memory_cap - c.peak_bytes) / GiB:.1f} GiB of the {cap:.1f} GiB cap), "
        f"{c.tokens_per_s:,.0f} tokens/s projected",
        *_contest_line(plan),
        f"  {lines['run']}",
        f"  {lines['srun']}",
        "",
        "pipeline config (workflows/config/<name>.yaml):",
        pipeline_config(req, c.run, models).rstrip(),
    ]
    return "\n".join(out)
