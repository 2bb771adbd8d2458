"""Throughput projection: a cost model that walks a strategy's step on a hardware preset.

Step time of one rank (the slowest rank is the same: zigzag balances the work):

    T = device + exposed host time,
    device = compute + critical comm + max(0, overlappable comm - overlap * compute)

- compute: GEMM FLOPs / GEMM rate + attention FLOPs / attention rate + elementwise bytes /
  memory bandwidth (FLOPs from :mod:`tspbench.projection.analytic`, elementwise traffic ~
  writing and reading every saved activation once per pass);
- host issue: operations per step x the per-operation overhead (kernel launch and the Python
  dispatcher); operations are counted on the real code under fake tensors, which is cheap
  because the count does not depend on the tensor sizes. A GPU runs a queue the host fills
  ahead of it, so only the part the device waits for is exposed (:func:`exposed_host`); on a
  CPU the same cores do both and all of it adds;
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

import collections
import functools
import itertools
import json
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from tspbench.core import datafiles
from tspbench.core.comm import KINDS, bus_bytes
from tspbench.core.config import ConfigError, read_json_input
from tspbench.core.mesh import Axis
from tspbench.projection import analytic
from tspbench.runtime.pipelined import check_projected, stages_per_rank
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


_MEMO: collections.OrderedDict[tuple, tuple[object, Any]] = collections.OrderedDict()


def _once(obj: object, key: tuple, make: Callable[[], Any]) -> Any:
    """``make()``, made once per live object ``obj`` and ``key`` (a plan projects thousands of
    cases on a few presets, each read many times): the entry holds ``obj`` itself, so its id
    is not reused while the entry lives, and the oldest of 512 entries goes first."""
    k = (id(obj), *key)
    hit = _MEMO.get(k)
    if hit is not None and hit[0] is obj:
        return hit[1]
    out = make()
    _MEMO[k] = (obj, out)
    if len(_MEMO) > 512:
        _MEMO.popitem(last=False)
    return out


def rates(preset: dict, ranks_per_node: int) -> dict[str, Any]:
    """Achievable rates per rank: measured at this many ranks per node, or from the datasheet
    (numbers, and tables of them: by collective kind, group size, GEMM size). Read-only, and
    made once per preset object."""
    return _once(preset, ("rates", ranks_per_node), lambda: _rates(preset, ranks_per_node))


def _rates(preset: dict, ranks_per_node: int) -> dict[str, Any]:
    if "ranks" in preset:  # calibrated: rates measured with P ranks sharing the machine
        table = preset["ranks"]
        p = min((int(k) for k in table if int(k) >= ranks_per_node), default=None)
        if p is None:
            raise ConfigError(
                f"hardware {preset['name']}: calibrated up to {max(map(int, table))} ranks per "
                f"node, the run needs {ranks_per_node}; calibrate with --ranks {ranks_per_node}"
            )
        return table[str(p)]
    node = preset.get("gpus_per_node", 8)
    return {
        "gemm_flops": preset["peak_flops"] * preset["gemm_efficiency"],
        "attention_flops": preset["peak_flops"] * preset["attention_efficiency"],
        "memory_bandwidth": preset["memory_bandwidth"] * preset["memory_efficiency"],
        "op_overhead_s": preset["op_overhead_s"],
        "overlap_efficiency": preset["overlap_efficiency"],
        **fabric(preset, node),
        "groups": {str(g): fabric(preset, g) for g in range(2, node + 1)},
        "inter": _inter(preset),
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
    for kind in out:
        sets = _published(preset, "intra", kind)
        if sets:
            out[kind] = out[kind] | _curve(preset, sets, 2 if kind == "send_recv" else size)
    return out


def _published(preset: dict, where: str, kind: str) -> list[dict]:
    """The preset's published measurements of ``kind`` (``intra`` or ``inter`` a node), or of
    the kind its ``proxy`` names where none of its own was published; across nodes, where
    neither was, the all-reduce's (NCCL's rings cross the nodes alike for every group-wide
    kind); none for a point-to-point hop across nodes (one NIC: the preset's NIC rate)."""
    coll = preset.get("collectives", {})
    if where == "inter" and kind == "send_recv":
        return []
    table = coll.get(where, {})
    sets = table.get(kind) or table.get(coll.get("proxy", {}).get(kind, ""))
    return sets or (table.get("all_reduce", []) if where == "inter" else [])


def _inter(preset: dict) -> dict[str, Any]:
    """The NIC's (latency, bandwidth), and per collective kind the published curve across
    nodes where the preset has one (``curves``)."""
    eff = preset.get("bus_efficiency", 1.0)
    out: dict[str, Any] = {"lat": preset["latency_inter_s"], "bw": preset["nic_bandwidth"] * eff}
    curves = {}
    for kind in KINDS:
        sets = _published(preset, "inter", kind)
        if sets:
            pick = min(sets, key=lambda m: m["gpus"])
            per_node = pick["gpus"] // pick.get("nodes", 1)
            curves[kind] = _curve(preset, [pick], 0) | {"per_node": per_node}
    return out | ({"curves": curves} if curves else {})


def _curve(preset: dict, sets: list[dict], size: int) -> dict[str, Any]:
    """The published curve of the measured group nearest ``size`` ranks (the smallest at least
    as large, else the largest): its time per call against nccl-tests'/rccl-tests' ``size``
    (:func:`_times`), the measured kind's bus factor, and ``curve_scale``, what the bandwidth
    part of a call's time is divided by: ``collective_efficiency`` (the curves' stated
    uncertainty: 1 as published) and, on a full mesh, the links a group of ``size`` drives
    (``size - 1``) over those the measured group of g drove (``g - 1``); on a switch every rank
    has its port whichever the group."""
    pick = min(sets, key=lambda m: (m["gpus"] < size, abs(m["gpus"] - size)))
    scale = preset.get("collective_efficiency", 1.0)
    if size and preset["topology"] == "full_mesh":
        links = preset["links"]
        scale *= min(links, size - 1) / min(links, pick["gpus"] - 1)
    factor = _nccl_factor(pick["collective"], pick["gpus"])
    return {"curve": _times(pick), "curve_factor": factor, "curve_scale": scale}


def _times(m: dict) -> tuple[tuple[float, float], ...]:
    """(message bytes, seconds per call) of one published measurement ``m``: its time where
    the source gives one (more digits than its busbw, which reads 0.00 at a few bytes), else
    from its busbw; never falling as the size grows (a message can be sent as a larger one: a
    row slower than the next larger one is a glitch of that run). Made once per measurement."""
    return _once(m, ("times",), lambda: _read_times(m))


def _read_times(m: dict) -> tuple[tuple[float, float], ...]:
    factor = _nccl_factor(m["collective"], m["gpus"])
    secs = [t * 1e-6 if t is not None else factor * x / (bw * 1e9) for x, bw, t in m["rows"]]
    out, fastest = [], math.inf  # (seconds of the smallest larger message, from the end)
    for row, t in zip(reversed(m["rows"]), reversed(secs)):
        fastest = min(fastest, t)
        out.append((float(row[0]), fastest))
    return tuple(out[::-1])


# nccl-tests' bus-bandwidth factor: busbw = algbw x this (its doc/PERFORMANCE.md)
def _nccl_factor(kind: str, size: int) -> float:
    if kind == "all_reduce":
        return 2 * (size - 1) / size
    if kind in ("broadcast", "reduce", "send_recv"):
        return 1.0
    return (size - 1) / size


def call_time(link: dict[str, Any], kind: str, nbytes: float, size: int) -> float:
    """Seconds of one ``kind`` over ``size`` ranks on a ``nbytes`` full tensor (the
    all-gather's output, the reduce-scatter's input: nccl-tests' ``size``). Where ``link``
    has a published curve (``collectives`` in hardware.json) it is read at this size, log-log
    between the measured sizes (the benchmark timed that very call: its latency, protocol and
    algorithm switches are in it); below the smallest size measured, that size's time (the
    floor); above the largest, its bandwidth. What the call takes above the floor is its
    bandwidth part, and only that converts to another kind or group (by the ratio of
    nccl-tests' bus factors: the same bus bandwidth) and scales with ``curve_scale`` (links,
    NICs, the stated uncertainty); the floor, a latency, stays. Without a curve: the latency
    plus the bus bytes over the link's bandwidth."""
    if size <= 1:
        return 0.0
    got = link.get("curves", {}).get(kind) or link
    curve = got.get("curve")
    if not curve:
        return link["lat"] + bus_bytes(kind, nbytes, size) / link["bw"]
    floor = curve[0][1]
    if nbytes <= curve[0][0]:
        return floor
    m_last, t_last = curve[-1]  # above the largest size: its bandwidth above the floor
    t = floor + (t_last - floor) * nbytes / m_last
    for (m1, t1), (m2, t2) in zip(curve, curve[1:]):
        if nbytes <= m2:
            t = t1 * math.exp(math.log(t2 / t1) * math.log(nbytes / m1) / math.log(m2 / m1))
            break
    ratio = _nccl_factor(kind, size) / got["curve_factor"]
    return floor + (t - floor) * ratio / got["curve_scale"]


def _link(rates: dict, kind: str) -> dict[str, float]:
    """The (latency, bandwidth) fit of ``kind``; a calibration written before the all-to-all
    was counted has none: it moves (D-1)/D of its tensor per rank, as a reduce-scatter does."""
    return rates[kind] if kind in rates or kind != "all_to_all" else rates["reduce_scatter"]


def crosses_nodes(c: RunSpec, axis: str, size: int, per_node: int) -> bool:
    """Whether a collective of ``size`` ranks on ``axis`` leaves a node: data parallelism where
    the world does, the model group's axes where the group does, but a2a+p2p's inner groups
    (``<axis>.a2a``: ``size`` consecutive context-parallel ranks, each T wide under tensor
    parallelism, laid from rank 0) only where one of them does: wider than a node, or not
    tiling it (6 ranks on 8-GPU nodes: the second group straddles two); TP+SP's tensor group
    (``tp``: T consecutive ranks) likewise, so a 16-rank TP+SP of T = 4 keeps its all-reduces
    in a node and sends only its context-parallel traffic across."""
    if axis == Axis.DP:
        return c.degree * c.dp > per_node
    if axis == Axis.PP:  # neighbouring stages are degree x dp ranks apart: some pair of them
        # is on two nodes once the world is (and the slowest hop paces the pipeline)
        return c.layout.world_size > per_node
    if axis.endswith(".a2a"):
        span = size * (c.degree // max(c.cp, 1))
        return span > per_node or per_node % span != 0
    if axis == Axis.TP:  # TP+SP's tensor group: T consecutive ranks
        return size > per_node or per_node % size != 0
    return c.degree > per_node


def ranks_per_node(c: RunSpec, axis: str, size: int, per_node: int) -> int:
    """How many of a ``size``-rank group's ranks on ``axis`` share a node, where it leaves one:
    a data-parallel group's ranks are ``degree`` apart (one per node once a model group fills
    it), a model group wider than a node fills each, TP+SP's context-parallel group and an
    a2a+p2p inner group have theirs T apart (tensor parallelism innermost)."""
    if axis == Axis.DP:
        return max(1, min(c.dp, per_node // c.degree))
    if axis == Axis.PP:
        return 1
    spread = axis == Axis.SP or axis.endswith(".a2a")
    stride = c.degree // max(c.cp, 1) if spread else 1
    return max(1, min(size, per_node // stride))


def group_link(
    c: RunSpec, r: dict[str, Any], axis: str, kind: str, size: int, per_node: int
) -> dict[str, Any]:
    """The link a ``size``-rank ``kind`` on ``axis`` of case ``c`` runs over: where the group
    leaves a node, the link across nodes at the group's ranks per node; else the node's link
    for a group of this size (a calibrated preset may hold fits per group size)."""
    if crosses_nodes(c, axis, size, per_node):
        return across(r, ranks_per_node(c, axis, size, per_node))
    return _link(r.get("groups", {}).get(str(size), r), kind)


def across(r: dict[str, Any], share: int) -> dict[str, Any]:
    """The link across nodes for a group with ``share`` ranks on each node: a published curve
    was measured with every GPU of each node in the group, its rings crossing the nodes over
    all their NICs at once; a group with fewer ranks per node drives that many NICs, so the
    curve's bandwidth scales by ``share`` over the measurement's GPUs per node (1 of 8: one
    NIC's worth, about what the datasheet model charged)."""
    link = r["inter"]
    curves = link.get("curves")
    if not curves:
        return link
    scaled = {
        kind: cv | {"curve_scale": cv["curve_scale"] * min(1.0, share / cv["per_node"])}
        for kind, cv in curves.items()
    }
    return link | {"curves": scaled}


def metric_reductions(c: RunSpec) -> list[tuple[str, int]]:
    """The reported loss's and gradient norm's small all-reduces: (axis, group size) each; the
    model group's are the strategy's (``metric_reductions``)."""
    out: list[tuple[str, int]] = [
        (Axis.MODEL, n) for n in c.impl.costs.metric_reductions(c.layout, c.train) if n > 1
    ]
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
    the degrees, heads, buckets and experts, not on tensor sizes, so hidden, head size, MLP
    (and experts') widths, vocabulary, sequence and batch are cut to the smallest values the
    strategy accepts, and dp to 1. Specs with the same key count the same (7B and 13B-shaped
    models with the same heads, any depth)."""
    cfg = c.cfg
    m = 2 * c.degree * max(c.tp, 1)
    shape = replace(cfg, hidden=cfg.heads * 2, head_dim=0, ffn=m, vocab=m, layers=1, name="shape")
    if cfg.moe:  # the experts' widths too (their number and k set the count: one GEMM each)
        shape = replace(
            shape, expert_ffn=m if cfg.expert_ffn else 0, shared_ffn=m * (cfg.shared_ffn > 0)
        )
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


def project(
    c: RunSpec,
    preset: dict,
    ops: int | None = None,
    prefill: bool = False,
    *,
    node_ranks: int | None = None,
    micro: bool = False,
) -> dict[str, Any]:
    """Projected step time and its parts for one rank of case ``c`` on ``preset``; with
    ``prefill``, of a decoder's prefill of the forward-only ``c``: its collectives (the
    decoder's ``prefill_schedule``) and FLOPs (the LM head on the last positions, no loss);
    a pipelined ``c``: :func:`project_pipeline` (``ops``: one stage's per micro-batch).
    ``node_ranks``: the ranks sharing a node, where ``c`` is part of a larger world (a
    pipeline's stage); ``micro``: one micro-batch of a pipeline's stage, whose once-per-step
    work (the ``per_step`` gradient reductions, the metrics' reductions) is left out of the
    step and timed apart, in ``once_s`` (those it overlaps, less what one micro-batch's compute
    hides)."""
    if c.layout.pp > 1:
        return project_pipeline(c, preset, ops)
    per_node = preset.get("gpus_per_node", 8)
    world = c.degree * c.dp
    r = rates(preset, node_ranks or min(world, per_node))
    fl = analytic.flop_parts(c, loss=not prefill)  # executed: recomputation takes time too
    elem = analytic.elementwise_bytes(c)
    gemm_rate = _rate(r, "gemm_flops", analytic.gemm_size(c))
    attn_rate = _rate(r, "attention_flops", c.cfg.d_head, key="attention_flops_by_d")
    compute = fl["gemm"] / gemm_rate + fl["attention"] / attn_rate
    compute += elem / r["memory_bandwidth"]
    ops = count_ops(c) if ops is None else ops
    crit = ovl = 0.0
    decoder = c.impl.decoder
    events = decoder.prefill_schedule(c) if prefill and decoder else analytic.schedule(c)
    same = collections.Counter(  # (a schedule repeats each layer's events: counted in C)
        (ev[1], ev[2], ev[3], ev.overlapped, micro and ev.per_step, ev[4])
        for ev in events
        if ev[3] > 1
    )
    once_s = once_ovl = 0.0
    for (axis, kind, size, overlapped, once, nbytes), n in same.items():
        t = n * call_time(group_link(c, r, axis, kind, size, per_node), kind, nbytes, size)
        if once and overlapped:  # (FSDP+CP's kept units, gathered in one micro-batch's forward)
            once_ovl += t
        elif once:
            once_s += t
        elif overlapped:  # what the implementation hides, as its schedule says
            ovl += t
        else:
            crit += t
    straggler = r.get("straggler", 1.0)  # the step waits for its slowest rank
    compute *= straggler
    for axis, size in metric_reductions(c):  # uncounted, but they synchronise the ranks
        lat = call_time(group_link(c, r, axis, "all_reduce", size, per_node), "all_reduce", 8, size)
        if micro:
            once_s += lat
        else:
            crit += lat
    hidden = min(ovl, r["overlap_efficiency"] * compute)
    device = compute + crit + ovl - hidden
    # once-a-step transfers the implementation overlaps (FSDP+CP's kept units, gathered one
    # ahead in the first micro-batch's forward) hide behind that forward (a third of a
    # training micro-batch's compute, a quarter with recomputation), where its own hidden
    # transfers leave room
    if once_ovl:
        fwd = 1 / (3 + c.rc) if c.train else 1.0
        room = fwd * (r["overlap_efficiency"] * compute - hidden)
        once_s += max(0.0, once_ovl - room)
    per_op = r["op_overhead_s"] * straggler
    base = {
        "device_s": device,
        "compute_s": compute,
        "comm_critical_s": crit,
        "comm_overlappable_s": ovl,
        "comm_hidden_s": hidden,
        "dispatch_s_per_op": per_op,
        "serial_dispatch": serial_dispatch(preset),
        **({"once_s": once_s} if micro else {}),
        "flops_per_rank": analytic.flops(c, loss=not prefill),  # model FLOPs, as a record's
        "flops_executed_per_rank": fl["gemm"] + fl["attention"],
        "tokens_per_step": c.batch * c.seq_len * c.dp,
        "peak_flops": preset.get("peak_flops"),
    }
    return recharge(base, ops)


def _preset_key(preset: dict) -> str:
    """``preset`` as canonical JSON, made once per preset object (its published curves make
    it long, and a plan prices thousands of pipelines on one preset)."""
    return _once(preset, ("key",), lambda: json.dumps(preset, sort_keys=True))


@functools.lru_cache(maxsize=4096)
def _slot(one: RunSpec, preset: str, node_ranks: int) -> dict[str, Any]:
    """:func:`project` of one stage on one micro-batch, without host time and its once-per-step
    work apart (many pipelines share it: a plan tries every micro-batch count of every batch)."""
    return project(one, json.loads(preset), 0, node_ranks=node_ranks, micro=True)


@functools.lru_cache(maxsize=4096)
def _one_replica(mb: RunSpec) -> RunSpec:
    return mb.replace(layout=replace(mb.layout, dp=1))


def _model_flops(c: RunSpec) -> int:
    """The whole model's FLOPs per rank of pipelined ``c`` (the same model group without
    stages, options of pipelines only at their defaults): cached, since every schedule and
    micro-batch count of one batch shares them."""
    flat = tuple((o.name, c.options[o.name]) for o in c.impl.options if o.applies(1, c.cfg.moe))
    return _flat_flops(c.strategy, c.cfg, replace(c.layout, pp=1), c.seq_len, c.batch, c.mode,
                       c.dtype, c.recompute, flat)  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _flat_flops(strategy: str, *args: Any) -> int:
    cfg, layout, seq_len, batch, mode, dtype, recompute, options = args
    whole = RunSpec(strategy=strategy, cfg=cfg, layout=layout, seq_len=seq_len, batch=batch,
                    mode=mode, dtype=dtype, recompute=recompute, options=dict(options))  # fmt: skip
    return analytic.flops(whole)


def project_pipeline(c: RunSpec, preset: dict, ops: int | None = None) -> dict[str, Any]:
    """A pipelined step (GPipe or 1F1B over pp equal stages, M micro-batches; interleaved 1F1B
    over pp x v stages, v per rank), as :mod:`tspbench.runtime.pipelined` runs it:

        T = (v M + pp - 1) x (t_stage + t_hop) + t_once + t_dp

    - t_stage: the slowest stage (the last: its layers, the head and the loss) on one
      micro-batch: :func:`project` of :func:`stages.micro_spec` (the model group's collectives
      and their overlap as in a whole step), without its host time. Under interleaved 1F1B
      every one of a rank's v M chunks is priced so, the head included, which the last rank
      runs in M of them only: an over-estimate by (v - 1) M heads;
    - t_hop: the micro-batch's activations sent to the next stage and, in training, their
      gradients back (b x S/cp x h elements each way): point-to-point over the NIC where the
      pipeline leaves a node (the stages are laid outermost, so it does once the world does),
      else over one intra-node link; charged on the critical path (torch's schedules wait for
      each receive before the compute that needs it);
    - (v M + pp - 1): the schedules' length in chunk slots, of which pp - 1 are the bubble
      (the closed form the records compare with, :func:`bubble_closed_form`); each chunk
      sends (Narayanan et al., 2021: interleaving divides the bubble by v for v times the
      point-to-point traffic);
    - t_dp: the stage's gradients summed over its dp replicas after the last backward, not
      hidden (the runtime issues it there: docs/running.md);
    - with tied embeddings, the all-reduce of the embedding's gradient between the first
      stage and the last stage's copy, once a step;
    - once a step, not per slot, for each of the rank's v stages (each a strategy of its own):
      the strategy's own gradient reductions after the schedule
      (``per_step`` events: SP's all-reduce of every gradient, TSP's of the norms), sized by
      the stage's model (both tables: an over-estimate by one), and the metrics' reductions.
    The host issues every chunk's operations: ``ops`` (one stage's on one micro-batch, counted
    on :func:`stages.micro_spec`) x v M."""
    from tspbench.projection import stages

    check_projected(c.pp_schedule)
    mb = stages.micro_spec(c)
    one = _one_replica(mb)
    pp, per_node = c.layout.pp, preset.get("gpus_per_node", 8)
    M = c.microbatches * stages_per_rank(c.pp_schedule)  # chunks a rank runs
    world = c.layout.world_size
    r = rates(preset, min(world, per_node))
    slot = _slot(one, _preset_key(preset), min(world, per_node))
    link = r["inter"] if crosses_nodes(c, Axis.PP, 2, per_node) else _link(r, "send_recv")
    sends = 2 if c.train else 1
    hop = sends * call_time(link, "send_recv", mb.tokens * c.cfg.hidden * c.e, 2)
    dp = 0.0
    if c.train and c.dp > 1:
        n = max(stages.stage_params(c, s) for s in range(pp))
        dlink = group_link(c, r, Axis.DP, "all_reduce", c.dp, per_node)
        dp = call_time(dlink, "all_reduce", n * c.e, c.dp)
    tie = 0.0  # tied embeddings: the first and last stages sum their copies' gradients
    if c.train and c.cfg.tie_embeddings:
        tlink = group_link(c, r, Axis.PP, "all_reduce", 2, per_node)
        tie = call_time(tlink, "all_reduce", stages.table_params(c) * c.e, 2)
    slots = M + pp - 1
    # each of the rank's stages' gradient reductions and the metrics, once a step
    once = stages_per_rank(c.pp_schedule) * slot["once_s"] + dp + tie
    base = {
        "device_s": slots * (slot["device_s"] + hop) + once,
        "compute_s": M * slot["compute_s"],
        "comm_critical_s": M * (slot["comm_critical_s"] + hop) + once,
        "comm_overlappable_s": M * slot["comm_overlappable_s"],
        "comm_hidden_s": M * slot["comm_hidden_s"],
        "pp_bubble_s": (pp - 1) * (slot["device_s"] + hop),
        "pp_bubble_fraction": (pp - 1) / slots,
        "pp_hop_s": hop,
        "pp_once_s": once - dp,  # (the tied embedding's all-reduce in it)
        "pp_tie_s": tie,
        "dp_reduce_s": dp,
        "dispatch_s_per_op": slot["dispatch_s_per_op"],
        "serial_dispatch": slot["serial_dispatch"],
        "op_repeats": M,  # the stage's operations, once per chunk
        "flops_per_rank": _model_flops(c) // pp,  # model FLOPs: a stage's share
        "flops_executed_per_rank": M * slot["flops_executed_per_rank"],
        "tokens_per_step": c.batch * c.seq_len * c.dp,
        "peak_flops": preset.get("peak_flops"),
    }
    return recharge(base, count_ops(mb) if ops is None else ops)


# which end of a rate's stated range makes a step faster: efficiencies and bandwidths high,
# overheads and latencies low (``rate_ranges`` in hardware.json)
_FAST_HIGH = ("efficiency", "bandwidth", "flops")


def corners(preset: dict) -> tuple[dict, dict]:
    """(fast, slow): ``preset`` with every rate its ``rate_ranges`` bound at the end that makes
    a step fastest, and at the other. A preset without ranges (a calibrated one) is its own
    two corners: its rates are measurements, not assumptions."""
    ranges = preset.get("rate_ranges", {})
    fast, slow = dict(preset), dict(preset)
    for name, (lo, hi) in ranges.items():
        high_is_fast = any(name.endswith(k) for k in _FAST_HIGH)
        fast[name], slow[name] = (hi, lo) if high_is_fast else (lo, hi)
    return fast, slow


def all_corners(preset: dict) -> list[dict]:
    """``preset`` at every combination of its rates' range ends (2^k presets for k ranged
    rates; itself where it states none): a ratio of two layouts, unlike a step time, can be
    extreme at any of them."""
    ranges = list(preset.get("rate_ranges", {}).items())
    out = []
    for ends in itertools.product(*(bounds for _, bounds in ranges)):
        out.append(preset | {name: v for (name, _), v in zip(ranges, ends)})
    return out


def ratio_ranges(cases: list[tuple[RunSpec, int]], preset: dict) -> list[tuple[float, float]]:
    """For each of ``cases`` (case, operations per step): the (lowest, highest) of its tokens/s
    over the fastest case of another strategy (a variant of its own, e.g. TSP's other K/V
    exchange, is not an alternative to it; where every case is one strategy's, over the fastest
    other case), over every corner of the preset's rate ranges, each case projected once per
    corner; the fastest other may change from corner to corner, as it would on a machine whose
    rates are those."""
    tokens = [[project(c, corner, n)["tokens_per_s"] for c, n in cases]
              for corner in all_corners(preset)]  # fmt: skip
    out = []
    for j, (c, _) in enumerate(cases):
        rivals = [k for k, (o, _) in enumerate(cases) if o.strategy != c.strategy]
        rivals = rivals or [k for k in range(len(cases)) if k != j]
        r = [t[j] / max(t[k] for k in rivals) for t in tokens]
        out.append((min(r), max(r)))
    return out


def project_range(c: RunSpec, preset: dict, ops: int | None = None) -> tuple[float, float]:
    """(fastest, slowest) step time of ``c`` over the preset's stated rate ranges (each rate at
    its bound; the step time moves one way with each rate, so the corners bound it)."""
    ops = count_ops(c) if ops is None else ops
    fast, slow = corners(preset)
    return project(c, fast, ops)["step_time_s"], project(c, slow, ops)["step_time_s"]


def serial_dispatch(preset: dict) -> bool:
    """Whether the host's issue time adds to the step: on a CPU (a calibrated ``cpu`` preset)
    the same cores dispatch and compute; a GPU runs a queue the host fills ahead of it."""
    return preset.get("device") == "cpu"


def exposed_host(host_s: float, device_s: float, per_op_s: float, serial: bool) -> float:
    """The host's issue time the step waits for. Serial (CPU): all of it. A GPU: launches are
    asynchronous, so the host only shows where the device drains its queue before the next
    operation arrives: the first launch after the step's synchronisation (its loss and
    gradient-norm reads), and whatever the host's issue takes beyond the device's own work
    (the host cannot get ahead of a queue it issues more slowly than the device runs it;
    docs/projection.md, "Dispatch")."""
    if serial:
        return host_s
    return min(host_s, per_op_s) + max(0.0, host_s - device_s)


def counted_ops(p: dict[str, Any]) -> int | None:
    """The operations a projection was charged with, as :func:`project` takes them back (a
    pipeline's ``ops_per_step`` is its stage's count times its micro-batches); None where it
    states none (:func:`project` then counts them)."""
    ops = p.get("ops_per_step")
    return None if ops is None else int(ops) // p.get("op_repeats", 1)


def recharge(p: dict[str, Any], ops: int) -> dict[str, Any]:
    """A projection with ``ops`` operations issued: its step time, throughput and MFU from its
    device time and the host's exposed issue time (:func:`exposed_host`). :func:`project` ends
    here; a plan recharges a configuration's bound (``ops=0``) once its operations are
    counted, for hundreds of candidates."""
    ops *= p.get("op_repeats", 1)  # a pipeline stage's, once per micro-batch
    host = ops * p["dispatch_s_per_op"]
    exposed = exposed_host(host, p["device_s"], p["dispatch_s_per_op"], p["serial_dispatch"])
    step = p["device_s"] + exposed
    peak = p["peak_flops"]
    head = {
        "step_time_s": step,
        "tokens_per_s": p["tokens_per_step"] / step,
        "mfu": p["flops_per_rank"] / step / peak if peak else None,
        "exposed_host_s": exposed,
        "dispatch_s": host,
        "ops_per_step": ops,
    }
    return head | {k: v for k, v in p.items() if k not in head}


def case_of_row(row: dict) -> RunSpec:
    """The analytic case of one row of an aggregate summary (measured records)."""
    from tspbench.core.config import get_config

    cfg = get_config(row["model"])
    if int(row.get("ffn", cfg.ffn)) != cfg.ffn:
        cfg = replace(cfg, ffn=int(row["ffn"]))

    def opt(k: str) -> int:
        v = row.get(k)
        return 1 if v is None or v != v else int(v)  # NaN: not a tpsp row

    # the row's options (NaN or absent: a row without one, at its default)
    cells = {o.name: (o, row.get(o.name)) for o in strategies()[row["strategy"]].options}
    given = {k: (o, v) for k, (o, v) in cells.items() if v is not None and v == v}
    options: dict[str, Any] = {k: o.from_cell(v) for k, (o, v) in given.items()}
    pipeline: dict[str, Any] = {}  # a pipelined row's (NaN elsewhere)
    if opt("pp") > 1:
        pipeline = {"pp": opt("pp"), "pp_schedule": row["pp_schedule"],
                    "microbatches": opt("microbatches")}  # fmt: skip
    return RunSpec.make(
        row["strategy"], cfg, degree=int(row["degree"]), tp=opt("tp"), sp=opt("sp"),
        dp=int(row["dp"]), seq_len=int(row["seq_len"]), batch=int(row["batch"]),
        mode=row["mode"], dtype=row["dtype"], recompute=row.get("recompute", "none"),
        **pipeline, **options,
    )  # fmt: skip
