"""``tspbench plan``: which strategy, degrees, micro-batch and recomputation to run a model with.

Every strategy of the registry is asked for its model groups (``sweep_layouts``) at every degree
D that divides the GPUs and fits a node (``max_degree``; TP+SP at every T x Sigma of D), data
parallelism fills the rest (dp = G / D); each group is tried with every micro-batch (1..16, or
the one that gives ``global_batch`` = B x dp), recomputation none and full, and, for a strategy
that reads KV buckets, bucket 0 (whole head groups) and 1. :class:`RunSpec` validates each
candidate (a rule it breaks is the candidate's binding constraint); the analytic model
(:func:`tspbench.projection.analytic.memory`, steady state) decides whether it fits the memory
cap; the cost model (:func:`tspbench.projection.costmodel.project`) projects step time, tokens/s
and MFU. A D=1 group of every multi-rank strategy is the single-device model: only the one-rank
strategy (``single``) stands for it.

Dispatch time needs the operations the real code issues (counted on fake tensors: seconds per
configuration). They depend on the strategy, its group, recomputation, bucket, mode, dtype and
model, never on S, the micro-batch or dp, so each configuration is counted once and kept on disk
(``~/.cache/tspbench``, keyed by the configuration and a digest of the step's source code). A
plan counts only what can change its answer: every configuration is first projected without
dispatch (an upper bound on its tokens/s); configurations are counted in the order of their
bounds until none left uncounted could enter the top rows or beat a strategy's best (branch and
bound), so every fitting row shown is exact and the rest are marked as bounds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tspbench.core.config import PRESETS, ConfigError, ModelConfig, load_model
from tspbench.core.strategy import Layout, Strategy
from tspbench.projection import analytic, costmodel
from tspbench.runtime.registry import strategies
from tspbench.runtime.spec import CHOICES, RunSpec

GiB = 2**30
MAX_BATCH = 4096  # tspbench run's --batch bound


# -- the question ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    """What to plan: a model on G GPUs of a hardware preset at sequence length S."""

    cfg: ModelConfig
    hardware: dict
    seq_len: int
    gpus: int
    memory_cap: int
    max_degree: int
    mode: str = "train"
    dtype: str = "bf16"
    global_batch: int | None = None
    max_batch: int = 16
    recompute: tuple[str, ...] = ("none", "full")
    model: str = ""  # as the user named it (preset or path)
    notes: tuple[str, ...] = ()

    @classmethod
    def make(
        cls,
        model: str,
        hardware: str | dict,
        seq_len: int,
        gpus: int,
        *,
        memory_cap: float | None = None,
        max_degree: int | None = None,
        **kw: Any,
    ) -> Request:
        """Resolve model (preset or config.json) and hardware (preset or calibrated .json); the
        memory cap defaults to the preset's ``memory_bytes``, the degree cap to its node size."""
        cfg, notes = load_model(model) if isinstance(model, str) else (model, [])
        preset = costmodel.load_preset(hardware) if isinstance(hardware, str) else hardware
        if memory_cap is None:
            if not preset.get("memory_bytes"):
                raise ConfigError(
                    f"--memory-cap: hardware {preset.get('name')!r} states no memory_bytes; "
                    "give the GPU memory in GiB"
                )
            memory_cap = preset["memory_bytes"]
        if (
            not (isinstance(memory_cap, int | float) and math.isfinite(memory_cap))
            or memory_cap <= 0
        ):
            raise ConfigError(f"--memory-cap={memory_cap!r}: must be a positive number of GiB")
        node = node_size(preset)
        max_degree = node if max_degree is None else max_degree
        for name, v, lo, hi in (
            ("--seq-len", seq_len, 1, 2**24),
            ("--gpus", gpus, 1, 65536),
            ("--max-degree", max_degree, 1, 65536),
            ("--max-batch", kw.get("max_batch", 16), 1, MAX_BATCH),
            ("--global-batch", kw.get("global_batch") or 1, 1, 2**24),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ConfigError(f"{name}={v!r}: must be an integer between {lo} and {hi}")
        for key, choices in CHOICES.items():
            values = kw.get(key, ())
            for v in values if isinstance(values, tuple) else (values,):
                if v not in choices:
                    raise ConfigError(f"--{key}={v!r}: must be one of {', '.join(choices)}")
        if kw.get("mode", "train") == "infer":
            kw["recompute"] = ("none",)  # recomputation is a training matter
        return cls(
            cfg=cfg, hardware=preset, seq_len=seq_len, gpus=gpus, memory_cap=int(memory_cap),
            max_degree=max_degree, model=model if isinstance(model, str) else cfg.name,
            notes=tuple(notes), **kw,
        )  # fmt: skip


def node_size(preset: dict) -> int:
    """GPUs per node of a preset (a calibrated one: the most ranks it was measured with)."""
    if "gpus_per_node" in preset:
        return int(preset["gpus_per_node"])
    return max((int(k) for k in preset.get("ranks", {})), default=8)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# -- what is tried --------------------------------------------------------------------------------
@dataclass
class Candidate:
    """One runnable (or refused) combination, and what the models say about it."""

    strategy: str
    layout: Layout
    batch: int
    recompute: str
    kv_bucket: int
    spec: RunSpec | None = None
    reason: str | None = None  # the validation rule it breaks
    peak: float | None = None  # bytes per GPU
    peak_source: str = "analytic"
    bound: dict | None = None  # projection without dispatch (an upper bound on tokens/s)
    proj: dict | None = None  # with the counted operations
    fits: bool = False
    estimate: dict | None = None  # the fake-tensor estimator's check, when asked

    @property
    def exact(self) -> bool:
        return self.proj is not None

    @property
    def result(self) -> dict | None:
        return self.proj or self.bound

    @property
    def tokens_per_s(self) -> float | None:
        return self.result["tokens_per_s"] if self.result else None


@dataclass
class Config:
    """A strategy's group with one recomputation and bucket, over its micro-batches."""

    strategy: str
    layout: Layout
    recompute: str
    kv_bucket: int
    candidates: list[Candidate] = field(default_factory=list)
    ops: int | None = None

    @property
    def label(self) -> str:
        return strategies()[self.strategy].label(self.layout)

    @property
    def valid(self) -> list[Candidate]:
        return [c for c in self.candidates if c.spec is not None]

    @property
    def fitting(self) -> list[Candidate]:
        return [c for c in self.valid if c.fits]

    def best(self) -> Candidate | None:
        """The fitting micro-batch with the most tokens/s, else the one nearest to fitting."""
        if self.fitting:
            return max(self.fitting, key=lambda c: c.tokens_per_s)
        return min(self.valid, key=lambda c: c.peak, default=None)

    def bound(self) -> float:
        return max((c.bound["tokens_per_s"] for c in self.fitting), default=0.0)


def one_rank_only(impl: type[Strategy]) -> bool:
    """A strategy whose model group is always one rank (``single``)."""
    return all(lay.degree == 1 for lay in impl.sweep_layouts([2], [[2, 1], [1, 2]]))


def reads_kv_bucket(spec: RunSpec) -> bool:
    """Whether the strategy reads ``kv_bucket`` (others ignore it, so accept any value)."""
    try:
        spec.replace(kv_bucket=-1)
    except ConfigError:
        return True
    return False


def _spec(req: Request, strategy: str, lay: Layout, batch: int, rc: str, kvb: int) -> RunSpec:
    return RunSpec(
        strategy=strategy, cfg=req.cfg, layout=lay, seq_len=req.seq_len, batch=batch,
        mode=req.mode, dtype=req.dtype, recompute=rc, kv_bucket=kvb, quiet=True,
    )  # fmt: skip


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
    configs, skipped = [], []
    for name, impl in strategies().items():
        single = one_rank_only(impl)
        for lay in impl.sweep_layouts(degrees, factors):
            if lay.degree == 1 and not single:
                continue  # the single-device model: the one-rank strategy stands for it
            lay = dataclasses.replace(lay, dp=req.gpus // lay.degree)
            batches = _batches(req, lay)
            base = None
            if not isinstance(batches, str):
                try:
                    base = _spec(req, name, lay, impl.replica_batch(lay), "none", 0)
                except ConfigError:
                    pass
            buckets = [0]
            if base is not None and reads_kv_bucket(base) and req.cfg.kv_heads // lay.degree > 1:
                buckets.append(1)  # the smallest bucket: one KV head per gather
            for rc in req.recompute:
                for kvb in buckets:
                    conf = Config(name, lay, rc, kvb)
                    if isinstance(batches, str):
                        conf.candidates.append(Candidate(name, lay, 0, rc, kvb, reason=batches))
                    for b in [] if isinstance(batches, str) else batches:
                        cand = Candidate(name, lay, b, rc, kvb)
                        try:
                            cand.spec = _spec(req, name, lay, b, rc, kvb)
                        except ConfigError as e:
                            cand.reason = str(e)
                        conf.candidates.append(cand)
                    configs.append(conf)
    for d in divisors(req.gpus):
        if d <= req.max_degree:
            continue
        for name, impl in strategies().items():
            for lay in impl.sweep_layouts([d], [[t, d // t] for t in divisors(d)]):
                if lay.degree != d:  # a one-rank strategy's group
                    continue
                lay = dataclasses.replace(lay, dp=req.gpus // d)
                try:
                    _spec(req, name, lay, impl.replica_batch(lay), "none", 0)
                    why = None
                except ConfigError as e:
                    why = str(e)
                skipped.append({"strategy": name, "label": impl.label(lay), "degree": d,
                                "tp": lay.tp, "sp": lay.sp, "rule": why})  # fmt: skip
    return configs, skipped


# -- caches ---------------------------------------------------------------------------------------
def cache_dir(path: str | os.PathLike | None = None) -> Path:
    """``path``, else $XDG_CACHE_HOME/tspbench, else ~/.cache/tspbench."""
    if path:
        return Path(path)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tspbench"


def code_digest() -> str:
    """A digest of the code a step runs (strategies, core, runtime's step, the estimator and the
    cost model): a cached count or estimate is reused only for the same code."""
    import baselines
    import tsp_impl
    import tspbench

    pkg = Path(tspbench.__file__).parent
    files = [
        *Path(tsp_impl.__file__).parent.glob("*.py"),
        *Path(baselines.__file__).parent.glob("*.py"),
    ]
    files += [*(pkg / "core").glob("*.py")]
    files += [pkg / "runtime" / f for f in ("measure.py", "flops.py", "spec.py", "registry.py")]
    files += [pkg / "projection" / f for f in ("estimate.py", "costmodel.py", "analytic.py")]
    import torch

    h = hashlib.sha256(torch.__version__.encode())
    for f in sorted(files):
        h.update(f"{f.parent.name}/{f.name}".encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def _ops_key(spec: RunSpec) -> str:
    lay = spec.layout
    cfg = {k: v for k, v in dataclasses.asdict(spec.cfg).items() if k != "name"}
    return json.dumps([spec.strategy, cfg, lay.degree, lay.tp, lay.sp, spec.mode, spec.dtype,
                       spec.recompute, spec.kv_bucket, spec.overlap], sort_keys=True)  # fmt: skip


class OpsCache:
    """Operations per step of a configuration (``costmodel.count_ops``), kept on disk. The count
    does not depend on S, the micro-batch or dp (the cost model counts a shrunk copy)."""

    def __init__(self, root: Path | None, digest: str | None = None) -> None:
        self.path = root / f"ops-{digest or code_digest()}.json" if root else None
        self.counts: dict[str, int] = {}
        self.counted = self.hits = 0
        self.count_s = 0.0
        if self.path:
            self.counts = self._read()

    def _read(self) -> dict[str, int]:
        """The counts on disk (an unreadable or foreign file counts as empty)."""
        try:
            data = json.loads(self.path.read_text()) if self.path.exists() else {}
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict):
            return {}
        return {k: v for k, v in data.items() if isinstance(v, int) and not isinstance(v, bool)}

    def get(self, spec: RunSpec) -> int:
        key = _ops_key(spec)
        if key in self.counts:
            self.hits += 1
            return self.counts[key]
        t0 = time.perf_counter()
        n = costmodel.count_ops(spec)
        self.count_s += time.perf_counter() - t0
        self.counted += 1
        self.counts[key] = n
        self._save(key, n)
        return n

    def _save(self, key: str, n: int) -> None:
        if not self.path:
            return
        from tspbench.runtime.record import write_atomic

        self.counts = {**self._read(), **self.counts, key: n}  # and what others wrote meanwhile
        try:
            write_atomic(self.path, json.dumps(self.counts))
        except OSError:
            self.path = None  # unwritable cache: keep counting in memory


def estimate_peak(spec: RunSpec, root: Path | None, kernel: str = "fused") -> dict:
    """The fake-tensor estimator's peak for rank 0 (zigzag's largest buffers), cached on disk
    by spec, kernel and code digest."""
    from tspbench.projection.estimate import estimate

    key = json.dumps([spec.to_argv(), kernel, dataclasses.asdict(spec.cfg)], sort_keys=True)
    path = None
    if root:
        path = (
            root
            / f"estimate-{code_digest()}"
            / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
        )
        if path.exists():
            try:
                old = json.loads(path.read_text())
                if isinstance(old.get("peak_mem_bytes"), int | float) and old.get("key") == key:
                    return {**old, "cached": True}
            except (OSError, ValueError, AttributeError):
                pass
    est = estimate(spec, [0], kernel)
    out = {"peak_mem_bytes": est["peak_mem_bytes"], "estimate_s": est["estimate_s"], "key": key}
    if path:
        from tspbench.runtime.record import write_json

        try:
            write_json(path, out)
        except OSError:
            pass
    return {**out, "cached": False}


# -- deciding -------------------------------------------------------------------------------------
@dataclass
class Row:
    """A configuration as the table shows it: its best micro-batch (or nearest to fitting)."""

    config: Config
    cand: Candidate

    @property
    def fits(self) -> bool:
        return self.cand.fits


@dataclass
class Plan:
    request: Request
    configs: list[Config]
    rows: list[Row]  # ranked: fitting by tokens/s, then the rest by peak memory
    shown: list[Row]  # what the table shows
    hidden: int  # fitting rows left out as dominated (same group, less memory and faster)
    skipped: list[dict]  # degrees above max_degree
    ops: OpsCache
    timings: dict[str, float]
    estimated: list[Candidate] = field(default_factory=list)  # checked by the estimator

    @property
    def best(self) -> Row | None:
        return next((r for r in self.rows if r.fits), None)

    @property
    def candidates(self) -> list[Candidate]:
        return [c for conf in self.configs for c in conf.candidates]


def _count(conf: Config, ops: OpsCache, preset: dict) -> None:
    conf.ops = ops.get(conf.valid[0].spec)
    for c in conf.valid:
        c.proj = costmodel.project(c.spec, preset, ops=conf.ops)


def rank(configs: list[Config]) -> list[Row]:
    rows = [Row(conf, conf.best()) for conf in configs if conf.valid]
    fit = sorted((r for r in rows if r.fits), key=lambda r: -r.cand.tokens_per_s)
    over = sorted((r for r in rows if not r.fits), key=lambda r: r.cand.peak)
    return fit + over


def _same_group(a: Row, b: Row) -> bool:
    la, lb = a.config.layout, b.config.layout
    return a.config.strategy == b.config.strategy and (la.degree, la.tp, la.sp) == (
        lb.degree, lb.tp, lb.sp)  # fmt: skip


def select(rows: list[Row], top: int) -> tuple[list[Row], int]:
    """The rows the table shows: the best ``top`` (a fitting row of the same group as a better
    one that needs no more memory is dominated and left out), then the best row of every
    strategy not shown yet; and how many were left out as dominated."""
    shown: list[Row] = []
    hidden = 0
    for r in rows:
        if r.fits and any(
            s.fits and _same_group(s, r) and s.cand.peak <= r.cand.peak for s in shown
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
            c.peak = float(analytic.memory(c.spec)["peak"])
            c.fits = c.peak <= req.memory_cap
            c.bound = costmodel.project(c.spec, req.hardware, ops=0)
    t2 = time.perf_counter()
    ops = ops or OpsCache(root)
    if exact:
        for conf in configs:
            if conf.valid:
                _count(conf, ops, req.hardware)
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
        rows = rank(configs)
        shown, hidden = select(rows, top)
        todo = [r.config for r in shown if r.fits and not r.cand.exact]
        if not todo:
            return rows, shown, hidden
        for conf in todo:
            _count(conf, ops, preset)


def _estimate(req, configs, n, kernel, root) -> list[Candidate]:
    """Re-check the best fitting rows with the estimator until ``n`` fit (at most 3n tries): a
    micro-batch over the cap is demoted, and its group's next best micro-batch competes."""
    checked: list[Candidate] = []
    while sum(c.fits for c in checked) < n and len(checked) < 3 * n:
        nxt = next((r for r in rank(configs) if r.fits and r.cand.estimate is None), None)
        if nxt is None:
            break
        c = nxt.cand
        c.estimate = estimate_peak(c.spec, root, kernel)
        c.peak, c.peak_source = float(c.estimate["peak_mem_bytes"]), f"estimate ({kernel})"
        c.fits = c.peak <= req.memory_cap
        checked.append(c)
    return checked


def limit(row: Row, req: Request) -> str:
    """What stops the row from going faster: memory, a rule, or the batch range."""
    c = row.cand
    if not c.fits:
        return f"memory: {c.peak / GiB:.1f} > {req.memory_cap / GiB:.1f} GiB"
    if req.global_batch is not None:
        return "global batch"
    bigger = [x for x in row.config.valid if x.batch > c.batch]
    if not bigger:
        return f"max batch {req.max_batch}"
    nxt = min(bigger, key=lambda x: x.batch)
    if not nxt.fits:
        return f"memory at B={nxt.batch} ({nxt.peak / GiB:.1f} GiB)"
    return "throughput (a larger batch fits but projects less)"


def binding(c: Candidate, req: Request) -> str | None:
    """The constraint a candidate breaks: a validation rule, memory, or none."""
    if c.spec is None:
        return c.reason
    return None if c.fits else "memory"


# -- what is printed ------------------------------------------------------------------------------
def describe(cfg: ModelConfig) -> str:
    return (
        f"h {cfg.hidden}, {cfg.layers} layers, {cfg.heads} heads / {cfg.kv_heads} KV, "
        f"f {cfg.ffn}, V {cfg.vocab}, {cfg.n_params() / 1e9:.2f}B parameters"
    )


def candidate_dict(c: Candidate, req: Request) -> dict[str, Any]:
    lay, r = c.layout, c.result or {}
    factors = strategies()[c.strategy].factors(lay)
    return {
        "strategy": c.strategy,
        "label": strategies()[c.strategy].label(lay),
        "degree": lay.degree,
        "tp": factors["tp"],
        "sp": factors["sp"],
        "dp": lay.dp,
        "gpus": lay.world_size,
        "batch": c.batch or None,  # None: no micro-batch splits the global batch
        "global_batch": c.batch * lay.dp or None,
        "seq_len": req.seq_len,
        "mode": req.mode,
        "dtype": req.dtype,
        "recompute": c.recompute,
        "kv_bucket": c.kv_bucket,
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


def nearest_preset(cfg: ModelConfig, names: list[str] | None = None) -> str:
    """The preset (of ``names``) that differs from ``cfg`` in the fewest fields."""
    fields = [f.name for f in dataclasses.fields(cfg) if f.name != "name"]
    names = [n for n in (names or list(PRESETS)) if n in PRESETS]
    return min(names, key=lambda n: sum(getattr(PRESETS[n], f) != getattr(cfg, f) for f in fields))


def run_argv(spec: RunSpec) -> list[str]:
    """``tspbench run`` arguments of a spec; a model that is no preset is spelt as the nearest
    preset with ``--set`` for every field that differs."""
    cfg, spec = spec.cfg, spec.replace(quiet=False)
    if PRESETS.get(cfg.name) != cfg:
        spec = spec.replace(cfg=dataclasses.replace(cfg, name=nearest_preset(cfg)))
    return spec.to_argv()


def run_lines(req: Request, spec: RunSpec, out: str = "runs/plan.json") -> dict[str, str]:
    """The ``tspbench run`` line (one node: local ranks; more: one rank per Slurm task) and the
    ``srun`` line for the cluster."""
    import shlex

    G, node = req.gpus, node_size(req.hardware)
    argv = [*run_argv(spec), "--device", "cuda", "--out", out]
    if G <= node:
        run = ["tspbench", "run", *argv, "--launch", "local", "--nproc", str(G)]
    else:  # started once per rank by srun or torchrun
        run = ["tspbench", "run", *argv, "--launch", "env"]
    per = min(G, node)
    srun = ["srun", f"--nodes={math.ceil(G / node)}", f"--ntasks={G}",
            f"--ntasks-per-node={per}", f"--gpus-per-node={per}", "--cpus-per-task=1",
            "--kill-on-bad-exit=1", "python", "-m", "tspbench", "run", *argv,
            "--launch", "env"]  # fmt: skip
    return {"run": shlex.join(run), "srun": shlex.join(srun)}


def pipeline_config(req: Request, spec: RunSpec, models: list[str] | None = None) -> str:
    """A sweep config (workflows/config/*.yaml) that runs the planned cell on the cluster;
    ``models``: the presets the config schema accepts."""
    import yaml

    base = nearest_preset(spec.cfg, models)
    over = {
        f.name: getattr(spec.cfg, f.name)
        for f in dataclasses.fields(spec.cfg)
        if f.name != "name" and getattr(spec.cfg, f.name) != getattr(PRESETS[base], f.name)
    }
    lay, impl = spec.layout, spec.impl
    sweep: dict[str, Any] = {"name": "plan", "strategies": [spec.strategy], "degrees": [lay.degree]}
    if impl.factors(lay)["tp"] is not None:
        sweep["tpsp"] = [[lay.tp, lay.sp]]
    sweep.update(gpus=[req.gpus], seq_lens=[req.seq_len], batches=[spec.batch], modes=[req.mode])
    hw = req.hardware.get("name")
    config: dict[str, Any] = {"name": f"plan-{base}-S{req.seq_len}-g{req.gpus}", "model": base}
    if over:
        config["model_overrides"] = over
    config.update(dtype=req.dtype, warmup=1, steps=3, recompute=spec.recompute, timeout=600,
                  gpu=True, gpus_per_node=node_size(req.hardware), launcher="srun")  # fmt: skip
    if hw in costmodel.presets():
        config["hardware_preset"] = hw
    config["sweeps"] = [sweep]
    head = f"# tspbench plan: {spec.label} D={lay.degree} dp={lay.dp} B={spec.batch}"
    if spec.kv_bucket:
        head += f"\n# kv_bucket={spec.kv_bucket}: no sweep key; pass --kv-bucket to tspbench run"
    return head + "\n" + yaml.safe_dump(config, sort_keys=False, default_flow_style=None)


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
            **run_lines(req, best.cand.spec),
        }
    return out


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
    for (label, D, why), batches in rules.items():
        some = f" (B={_ranges(sorted(batches))})" if (label, D) in runnable else ""
        lines.append(f"{label} D={D}{some}: {why}")
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
    out = [
        f"PROJECTED plan: {req.model} ({describe(req.cfg)})",
        f"  {req.mode} {req.dtype}, S={req.seq_len}, {req.gpus} GPUs of {req.hardware.get('name')}"
        f" ({node_size(req.hardware)} per node, D <= {req.max_degree}), memory cap {cap:.1f} GiB,"
        f" {batches}",
        f"  {len(plan.candidates)} candidates in {len(plan.configs)} configurations: {n_fit} fit, "
        f"{n_valid - n_fit} over memory, {len(plan.candidates) - n_valid} refused by a rule; "
        f"operations counted for {plan.ops.counted} configurations, {plan.ops.hits} cached, of "
        f"{n_conf}; {plan.timings['total_s']:.1f} s",
        *(f"  note: {n}" for n in req.notes),
        "",
    ]
    head = ["#", "strategy", "D", "dp", "B", "recompute", "kvb", "peak GiB", "headroom",
            "fits", "tokens/s", "tok/s/GPU", "MFU", "step s", "limit"]  # fmt: skip
    table = []
    for i, r in enumerate(plan.shown, 1):
        c, res = r.cand, r.cand.result or {}
        src = "*" if c.peak_source != "analytic" else ""
        table.append([
            str(i), r.config.label, str(c.layout.degree), str(c.layout.dp), str(c.batch),
            c.recompute, str(c.kv_bucket), f"{c.peak / GiB:.1f}{src}",
            f"{(req.memory_cap - c.peak) / GiB:.1f}", "yes" if c.fits else "NO", _fmt_rate(c),
            ("" if c.exact else "<=") + f"{res['tokens_per_s'] / req.gpus:,.0f}" if res else "-",
            f"{res['mfu']:.1%}" if res.get("mfu") is not None else "-",
            f"{res['step_time_s']:.3f}" if res else "-", limit(r, req),
        ])  # fmt: skip
    widths = [max(len(x) for x in col) for col in zip(head, *table)]
    right = {0, 2, 3, 4, 6, 7, 8, 10, 11, 12, 13}
    for line in [head, *table]:
        cells = [
            x.rjust(w) if k in right else x.ljust(w) for k, (x, w) in enumerate(zip(line, widths))
        ]
        out.append("  ".join(cells).rstrip())
    foot = "fitting rows by tokens/s, then the rest by peak memory"
    if plan.hidden:
        foot += f"; {plan.hidden} dominated rows not shown (same group: faster with less memory)"
    out.append(f"({foot}; <=: upper bound, dispatch not counted; peak: analytic steady state"
               + ("; *: fake-tensor estimate" if plan.estimated else "") + ")")  # fmt: skip
    if any(c.kv_bucket for c in plan.candidates if c.spec):
        out.append("(the analytic memory models whole head groups: a KV bucket's saving shows "
                   "only with --estimate)")  # fmt: skip
    for c in plan.estimated:
        out.append(
            f"estimator: {strategies()[c.strategy].label(c.layout)} D={c.layout.degree} "
            f"B={c.batch} {c.recompute} kvb={c.kv_bucket}: {c.peak / GiB:.1f} GiB, "
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
    lines = run_lines(req, c.spec)
    out += [
        f"best plan: {best.config.label} D={c.layout.degree} dp={c.layout.dp} B={c.batch} "
        f"recompute={c.recompute} kv_bucket={c.kv_bucket}: {c.peak / GiB:.1f} GiB per GPU "
        f"({c.peak_source}), {c.tokens_per_s:,.0f} tokens/s projected",
        f"  {lines['run']}",
        f"  {lines['srun']}",
        "",
        "pipeline config (workflows/config/<name>.yaml):",
        pipeline_config(req, c.spec, models).rstrip(),
    ]
    return "\n".join(out)
