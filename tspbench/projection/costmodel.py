"""Throughput projection: a cost model that walks a strategy's step on a hardware preset.

Step time of one rank (the slowest rank is the same: zigzag balances the work):

    T = compute + dispatch + critical comm + max(0, overlappable comm - overlap * compute)

- compute: GEMM FLOPs / GEMM rate + attention FLOPs / attention rate + elementwise bytes /
  memory bandwidth (FLOPs from :mod:`tspbench.projection.analytic`, elementwise traffic ~
  writing and reading every saved activation once per pass);
- dispatch: operations per step x the per-operation overhead (kernel launch on a GPU, the
  Python dispatcher on a CPU); operations are counted on the real code under fake tensors, which
  is cheap because the count does not depend on the tensor sizes;
- communication: every collective of :func:`tspbench.projection.analytic.schedule` costs a
  latency plus its bus bytes over the bandwidth of its link class and group size
  (:func:`fabric`): the model group inside a node uses the intra-node fabric (on a fully
  connected mesh a collective of g ranks drives the g-1 links to its peers at once, a
  point-to-point ring hop only one; on a switch every rank has one port of the full bandwidth;
  a broadcast or reduce moves the whole tensor through each link it uses, as its pipelined
  algorithm does), data parallelism and model groups larger than a node use the NIC;
- overlap: the events the strategy's schedule marks ``overlapped`` (what its code issues
  asynchronously ahead of, or drains behind, compute that does not wait for them: TSP's
  prefetched weight broadcasts, ring hops and drained weight-gradient reduces; FSDP+CP's
  prefetched unit all-gathers and drained gradient reduce-scatters; the data-parallel bucketed
  all-reduce) hide behind compute up to the preset's overlap efficiency; everything else (K/V
  all-gathers, tensor parallelism's all-reduces, the first transfer of a prefetch loop) is on
  the critical path.
Presets: :data:`PRESETS` (datasheets, with sources) or a file written by ``tspbench calibrate``.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from tspbench.core import datafiles
from tspbench.core.comm import bus_bytes
from tspbench.core.config import ConfigError, read_csv_input, read_json_input
from tspbench.core.mesh import Axis
from tspbench.projection import analytic
from tspbench.runtime.registry import strategies
from tspbench.runtime.spec import RunSpec


def presets() -> dict[str, dict]:
    data = json.loads(datafiles.read_text("projection/hardware.json"))
    return {k: v for k, v in data.items() if not k.startswith("_")}


def load_preset(name_or_path: str) -> dict:
    """A preset by name, or a JSON file written by ``tspbench calibrate``."""
    known = presets()
    if name_or_path in known:
        return {"name": name_or_path, **known[name_or_path]}
    path = Path(name_or_path)
    if path.suffix == ".json" and path.exists():
        preset = read_json_input(path, "--hardware")
        if not isinstance(preset, dict) or "ranks" not in preset and "peak_flops" not in preset:
            raise ConfigError(f"--hardware={name_or_path}: not a hardware preset file")
        return {"name": path.stem, **preset}
    raise ConfigError(
        f"--hardware={name_or_path!r}: must be one of {', '.join(sorted(known))} "
        "or a preset .json written by `tspbench calibrate`"
    )


def usable_memory(preset: dict) -> float:
    """Bytes a run can allocate on one device of ``preset``: what the driver reports, less the
    context, the collectives' buffers and the BLAS workspaces, less the allocator's
    fragmentation reserve (``usable_memory`` in hardware.json, with sources). A preset without
    that breakdown (calibrated: it measured the free memory) is taken at ``memory_bytes``."""
    u = preset.get("usable_memory")
    if not u:
        return float(preset.get("memory_bytes") or math.inf)
    left = u["visible_bytes"] - u["context_bytes"] - u["collective_bytes"]
    return float(math.floor((left - u["blas_workspace_bytes"]) * (1 - u["fragmentation"])))


def rates(preset: dict, ranks_per_node: int) -> dict[str, float]:
    """Achievable rates per rank: measured at this many ranks per node, or from the datasheet."""
    if "ranks" in preset:  # calibrated: rates measured with P ranks sharing the machine
        table = preset["ranks"]
        p = min((int(k) for k in table if int(k) >= ranks_per_node), default=None)
        if p is None:
            raise ConfigError(
                f"hardware {preset['name']}: calibrated up to {max(map(int, table))} ranks per "
                f"node, the run needs {ranks_per_node}; calibrate with --ranks {ranks_per_node}"
            )
        return table[str(p)]
    eff = preset.get("bus_efficiency", 1.0)
    node = preset.get("gpus_per_node", 8)
    return {
        "gemm_flops": preset["peak_flops"] * preset["gemm_efficiency"],
        "attention_flops": preset["peak_flops"] * preset["attention_efficiency"],
        "memory_bandwidth": preset["memory_bandwidth"] * preset["memory_efficiency"],
        "op_overhead_s": preset["op_overhead_s"],
        "overlap_efficiency": preset["overlap_efficiency"],
        **fabric(preset, node),
        "groups": {str(g): fabric(preset, g) for g in range(2, node + 1)},
        "inter": {"lat": preset["latency_inter_s"], "bw": preset["nic_bandwidth"] * eff},
    }


def fabric(preset: dict, size: int) -> dict[str, dict[str, float]]:
    """A datasheet preset's intra-node (latency, bandwidth) per collective kind for a group of
    ``size`` ranks; bandwidths in bus bytes per second (what :func:`project` divides
    :func:`bus_bytes` by), so an algorithm that moves more than the bus bytes gets a lower one.

    - ``full_mesh`` (``links`` links per GPU, one to each peer): a group reaches its peers over
      ``p = min(links, size - 1)`` links at once. All-gather, reduce-scatter and all-reduce move
      their bus bytes over all p. A broadcast (reduce) from (to) one owner runs as p pipelined
      edge-disjoint rings (trees), each carrying 1/p of the tensor: the whole tensor over p
      links, which is the bus bytes ((size-1)/size of it) at ``p * link * (size-1)/size``.
    - ``switch`` (one port per GPU to a switch): collectives at the port's bandwidth; a broadcast
      or reduce is pipelined along a ring, every rank receiving (sending) the whole tensor
      through its port: ``link * (size-1)/size`` in bus bytes.
    - a point-to-point ring hop (``send_recv``): one link, on either.
    """
    link = preset["link_bandwidth"] * preset.get("bus_efficiency", 1.0)
    paths = min(preset["links"], size - 1) if preset["topology"] == "full_mesh" else 1
    lat = preset["latency_intra_s"]
    whole = (size - 1) / size  # bus bytes per byte of a broadcast's or reduce's tensor
    out = {kind: {"lat": lat, "bw": paths * link} for kind in analytic.KINDS_COLLECTIVE}
    for kind in ("broadcast", "reduce"):
        out[kind] = {"lat": lat, "bw": paths * link * whole}
    out["send_recv"] = {"lat": lat, "bw": link}
    return out


def metric_reductions(c: RunSpec) -> list[tuple[str, int]]:
    """The reported loss's and gradient norm's small all-reduces: (axis, group size) each; the
    model group's are the strategy's (``metric_reductions``)."""
    out = [(Axis.MODEL, n) for n in c.impl.metric_reductions(c.layout, c.train) if n > 1]
    return out + ([(Axis.DP, c.dp)] if c.dp > 1 else [])


def _rate(r: dict, name: str, size: float, key: str | None = None) -> float:
    """A rate for this size: log-interpolated in a calibrated table, else the flat rate."""
    table = r.get(key or name + "_by_n")
    if not table:
        return r[name]
    pts = sorted((float(k), v) for k, v in table.items())
    if size <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if size <= x1:
            w = math.log(size / x0) / math.log(x1 / x0)
            return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))
    return pts[-1][1]


def count_key(c: RunSpec) -> RunSpec:
    """The one-layer shrunk copy of ``c`` whose operations are counted: the count depends on
    the degrees, heads and buckets, not on tensor sizes, so hidden, MLP, vocabulary, sequence
    and batch are cut to the smallest values the strategy accepts, and dp to 1. Specs with the
    same key count the same (7B and 13B-shaped models with the same heads, any depth)."""
    cfg = c.cfg
    m = 2 * c.degree * max(c.tp, 1)
    shape = replace(cfg, hidden=cfg.heads * 2, ffn=m, vocab=m, layers=1, name="shape")
    batch = c.impl.replica_batch(c.layout)
    return c.replace(
        cfg=shape, seq_len=4 * max(c.cp, 1), batch=batch, layout=replace(c.layout, dp=1)
    )


@functools.lru_cache(maxsize=1024)
def layer_counts(key: RunSpec) -> tuple[int, int]:
    """Operations of the one- and two-layer copies of a :func:`count_key` (fake tensors)."""
    from tspbench.projection.estimate import count_rank_ops

    two = key.replace(cfg=replace(key.cfg, layers=2))
    return count_rank_ops(key), count_rank_ops(two)


def extrapolate(counts: tuple[int, int], layers: int) -> int:
    """Every layer dispatches the same operations: one- and two-layer counts give any depth."""
    n1, n2 = counts
    return n1 + (layers - 1) * (n2 - n1)


def count_ops(c: RunSpec) -> int:
    """Operations the real code dispatches per step: counted on a shrunk copy under fake tensors
    (:func:`count_key`) at one and two layers, extrapolated to ``c``'s depth."""
    return extrapolate(layer_counts(count_key(c)), c.cfg.layers)


def project(c: RunSpec, preset: dict, ops: int | None = None) -> dict[str, Any]:
    """Projected step time and its parts for one rank of case ``c`` on ``preset``."""
    per_node = preset.get("gpus_per_node", 8)
    world = c.degree * c.dp
    r = rates(preset, min(world, per_node))
    fl = analytic.flop_parts(c)  # executed: recomputation takes time too
    elem = analytic.elementwise_bytes(c)
    gemm_rate = _rate(r, "gemm_flops", analytic.gemm_size(c))
    attn_rate = _rate(r, "attention_flops", c.cfg.head_dim, key="attention_flops_by_d")
    compute = fl["gemm"] / gemm_rate + fl["attention"] / attn_rate
    compute += elem / r["memory_bandwidth"]
    ops = count_ops(c) if ops is None else ops
    dispatch = ops * r["op_overhead_s"]
    crit = ovl = 0.0
    for ev in analytic.schedule(c):
        _, axis, kind, size, nbytes = ev
        if size <= 1:
            continue
        inter = axis == Axis.DP and world > per_node or axis != Axis.DP and c.degree > per_node
        # a calibrated preset may hold fits per group size (groups of 2 in a 4-rank node...)
        link = r["inter"] if inter else r.get("groups", {}).get(str(size), r)[kind]
        t = link["lat"] + bus_bytes(kind, nbytes, size) / link["bw"]
        if ev.overlapped:  # what the implementation hides, as its schedule says
            ovl += t
        else:
            crit += t
    straggler = r.get("straggler", 1.0)  # the step waits for its slowest rank
    compute, dispatch = compute * straggler, dispatch * straggler
    for _, size in metric_reductions(c):  # uncounted, but they synchronise the ranks
        crit += r.get("groups", {}).get(str(size), r)["all_reduce"]["lat"]
    hidden = min(ovl, r["overlap_efficiency"] * compute)
    step = compute + dispatch + crit + ovl - hidden
    tokens = c.batch * c.seq_len * c.dp
    model = analytic.flops(c)  # MFU counts model FLOPs, as a record's (no recomputation)
    return {
        "step_time_s": step,
        "tokens_per_s": tokens / step,
        "compute_s": compute,
        "dispatch_s": dispatch,
        "comm_critical_s": crit,
        "comm_overlappable_s": ovl,
        "comm_hidden_s": hidden,
        "ops_per_step": ops,
        "dispatch_s_per_op": r["op_overhead_s"] * straggler,
        "flops_per_rank": model,
        "flops_executed_per_rank": fl["gemm"] + fl["attention"],
        "mfu": model / step / preset["peak_flops"] if "peak_flops" in preset else None,
    }


def recharge(p: dict[str, Any], ops: int) -> dict[str, Any]:
    """A projection of :func:`project` with ``ops`` operations charged instead of its own: the
    dispatch term is the only one that depends on them (what a plan does to a configuration's
    bound once its operations are counted, for hundreds of candidates)."""
    dispatch = ops * p["dispatch_s_per_op"]
    step = p["step_time_s"] - p["dispatch_s"] + dispatch
    scale = p["step_time_s"] / step
    return p | {
        "step_time_s": step,
        "tokens_per_s": p["tokens_per_s"] * scale,
        "dispatch_s": dispatch,
        "ops_per_step": ops,
        "mfu": None if p["mfu"] is None else p["mfu"] * scale,
    }


def case_of_row(row: dict) -> RunSpec:
    """The analytic case of one row of an aggregate summary (measured records)."""
    from tspbench.core.config import get_config

    cfg = get_config(row["model"])
    if int(row.get("ffn", cfg.ffn)) != cfg.ffn:
        cfg = replace(cfg, ffn=int(row["ffn"]))

    def opt(k: str) -> int:
        v = row.get(k)
        return 1 if v is None or v != v else int(v)  # NaN: not a tpsp row

    cells = {o.name: (o, row.get(o.name)) for o in strategies()[row["strategy"]].options}
    return RunSpec.make(
        row["strategy"],
        cfg,
        degree=int(row["degree"]),
        tp=opt("tp"),
        sp=opt("sp"),
        dp=int(row["dp"]),
        seq_len=int(row["seq_len"]),
        batch=int(row["batch"]),
        mode=row["mode"],
        dtype=row["dtype"],
        recompute=row.get("recompute", "none"),
        **{k: o.from_cell(v) for k, (o, v) in cells.items() if v is not None and v == v},
    )  # fmt: skip  (NaN or absent: a row without the option, at its default)


def check_summary(paths: list[str], preset: dict):
    """Predicted against measured step time for every cell that succeeded in every summary CSV.

    Several summaries are repeated runs of one sweep: the measured time is their median, and
    the runs' range is kept so that each error can be read against the machine's own
    run-to-run spread.
    """
    import pandas as pd

    runs = []
    for path in paths:
        df = read_csv_input(path, "--summary")
        if "mode" in df.columns:  # decode cells are projected by projection/decode.py
            df = df[~df["mode"].isin(["decode", "generate"])]
        runs.append(df[df["status"] == "ok"].drop_duplicates("cell").set_index("cell"))
    cells = [c for c in runs[0].index if all(c in r.index for r in runs[1:])]
    rows = []
    for cell in cells:
        row = runs[0].loc[cell].to_dict()
        times = sorted(float(r.loc[cell, "step_time_s"]) for r in runs)
        measured = statistics.median(times)
        c = case_of_row(row)
        p = project(c, preset)
        rows.append(
            {
                "strategy": c.strategy,
                "label": row.get("label", ""),
                "seq_len": c.seq_len,
                "degree": c.degree,
                "dp": c.dp,
                "batch": c.batch,
                "mode": c.mode,
                "runs": len(times),
                "measured_s": measured,
                "measured_min_s": times[0],
                "measured_max_s": times[-1],
                "spread": times[-1] / times[0] - 1,
                "projected_s": p["step_time_s"],
                "error": p["step_time_s"] / measured - 1,
                "inside_range": times[0] <= p["step_time_s"] <= times[-1],
                "compute_s": p["compute_s"],
                "dispatch_s": p["dispatch_s"],
                "comm_s": p["comm_critical_s"] + p["comm_overlappable_s"] - p["comm_hidden_s"],
            }
        )
    return pd.DataFrame(rows)


def check_footer(table) -> str:
    """One paragraph: how many cells are within 25%, against the run-to-run spread."""
    errs = table["error"].abs()
    n = len(table)
    text = (
        f"{n} cells; |error| median {errs.median():.1%}, max {errs.max():.1%}; "
        f"within 25%: {(errs <= 0.25).sum()}/{n}"
    )
    if n and table["runs"].min() > 1:
        spread = table["spread"]
        text += (
            f". Measured = median of {table['runs'].min()} runs; run-to-run spread (max/min - 1) "
            f"median {spread.median():.1%}, max {spread.max():.1%}; projection inside the "
            f"measured range: {table['inside_range'].sum()}/{n}; within 25% or inside the "
            f"range: {((errs <= 0.25) | table['inside_range']).sum()}/{n}"
        )
    return text + "\n"
