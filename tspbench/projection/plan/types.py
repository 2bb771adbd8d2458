"""The planner's records: the question (:class:`Request`, checked when made) and what a plan
tries and answers (:class:`Candidate`, :class:`Config`, :class:`Row`, :class:`Plan`). They live
apart from the enumeration and ranking (:mod:`.search`) so that the rendering, the commands, the
maps and the check can use them without the planner's machinery.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tspbench.core.config import ConfigError, ModelConfig, load_model
from tspbench.core.options import Value
from tspbench.core.strategy import Layout
from tspbench.projection import costmodel
from tspbench.projection.plan.cache import OpsCache
from tspbench.runtime.registry import searched, strategies
from tspbench.runtime.spec import CHOICES, DECODE_MODES, RunSpec

MAX_BATCH = 4096  # tspbench run's --batch bound


# -- the question ---------------------------------------------------------------------------------
# the pipelines' schedules tried unless asked otherwise: 1F1B (GPipe's projected step is 1F1B's
# with more micro-batches in flight: it never wins; interleaved 1F1B's memory misses what torch's
# multi-stage runtime holds until a step ends: docs/projection.md, "Pipelines")
DEFAULT_SCHEDULES = ("1f1b",)


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
    new_tokens: int = 0  # decode, generate: tokens generated per sequence
    dtype: str = "bf16"
    global_batch: int | None = None
    max_batch: int = 16
    recompute: tuple[str, ...] = ("none", "full")
    options: Mapping[str, tuple[Value, ...]] = field(default_factory=dict)  # searched options
    # restricted to these values (the rest: every value the strategy offers)
    pp: tuple[int, ...] = ()  # pipeline stages to try (empty: 1 and every pp that divides the
    # layers and G / D, for the strategies that run as stages)
    pp_schedules: tuple[str, ...] = DEFAULT_SCHEDULES  # (--pp-schedule)
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
        memory cap defaults to the preset's usable memory (``costmodel.usable_memory``), the
        degree cap to its node size."""
        cfg, notes = load_model(model) if isinstance(model, str) else (model, [])
        preset = costmodel.load_preset(hardware) if isinstance(hardware, str) else hardware
        memory_cap = _memory_cap(preset, memory_cap)
        node = node_size(preset)
        max_degree = node if max_degree is None else max_degree
        _check_sizes(seq_len, gpus, max_degree, kw)
        _check_choices(kw)
        _check_options(kw.get("options", {}))
        _set_mode(kw)
        _check_pipeline(kw)
        return cls(
            cfg=cfg, hardware=preset, seq_len=seq_len, gpus=gpus, memory_cap=int(memory_cap),
            max_degree=max_degree, model=model if isinstance(model, str) else cfg.name,
            notes=tuple(notes), **kw,
        )  # fmt: skip


def _memory_cap(preset: dict, memory_cap: float | None) -> float:
    """The memory cap asked for, else the preset's usable memory: a positive number of bytes."""
    if memory_cap is None:
        if not preset.get("memory_bytes"):
            raise ConfigError(
                f"--memory-cap: hardware {preset.get('name')!r} states no memory_bytes; "
                "give the GPU memory in GiB"
            )
        memory_cap = costmodel.usable_memory(preset)
    if not (isinstance(memory_cap, int | float) and math.isfinite(memory_cap)) or memory_cap <= 0:
        raise ConfigError(f"--memory-cap={memory_cap!r}: must be a positive number of GiB")
    return memory_cap


def _check_sizes(seq_len: int, gpus: int, max_degree: int, kw: dict[str, Any]) -> None:
    """S, GPUs, the degree cap, the micro-batch cap and the global batch: integers in range."""
    for name, v, lo, hi in (
        ("--seq-len", seq_len, 1, 2**24),
        ("--gpus", gpus, 1, 65536),
        ("--max-degree", max_degree, 1, 65536),
        ("--max-batch", kw.get("max_batch", 16), 1, MAX_BATCH),
        ("--global-batch", kw.get("global_batch") or 1, 1, 2**24),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ConfigError(f"{name}={v!r}: must be an integer between {lo} and {hi}")


def _check_choices(kw: dict[str, Any]) -> None:
    """Each run setting with fixed choices (mode, dtype, recompute): one of them."""
    for key, choices in CHOICES.items():
        values = kw.get(key, ())
        for v in values if isinstance(values, tuple) else (values,):
            if v not in choices:
                raise ConfigError(f"--{key}={v!r}: must be one of {', '.join(choices)}")


def _check_pipeline(kw: dict[str, Any]) -> None:
    """The pipeline sizes asked for: positive integers; the schedules: ones the runtime has."""
    from tspbench.runtime.pipelined import check_projected

    for v in kw.get("pp", ()):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 65536:
            raise ConfigError(f"--pp={v!r}: must be an integer between 1 and 65536")
    mode = kw.get("mode", "train")
    if any(v > 1 for v in kw.get("pp", ())) and mode not in ("train", "infer"):
        raise ConfigError(f"--pp: pipelines here train or infer (got --mode {mode})")
    for v in kw.get("pp_schedules", ()):
        check_projected(v, "--pp-schedule")


def _check_options(options: Mapping[str, tuple[Value, ...]]) -> None:
    """Each option restricted: one the planner searches, each value one it takes."""
    for name, values in options.items():
        option = searched().get(name)
        if option is None:
            raise ConfigError(f"--{name}: not an option the planner searches")
        for v in values:
            try:
                option.check(v)
            except ConfigError as e:
                raise ConfigError(f"--{e}") from None


def _set_mode(kw: dict[str, Any]) -> None:
    """The settings a mode fixes, in ``kw``: no recomputation outside training, the tokens a
    decode or generate run makes (and none for the others)."""
    mode = kw.get("mode", "train")
    if mode != "train":
        kw["recompute"] = ("none",)  # recomputation is a training matter
    if mode in DECODE_MODES:
        kw["new_tokens"] = kw.get("new_tokens") or 16  # tspbench run's default
        if not 2 <= kw["new_tokens"] <= 2**20:
            raise ConfigError(f"--new-tokens={kw['new_tokens']!r}: must be 2..{2**20}")
    elif kw.get("new_tokens"):
        raise ConfigError(
            f"--new-tokens={kw['new_tokens']!r}: only --mode decode or generate generates"
        )
    else:
        kw["new_tokens"] = 0


def node_size(preset: dict) -> int:
    """GPUs per node of a preset (a calibrated one: the most ranks it was measured with)."""
    if "gpus_per_node" in preset:
        return int(preset["gpus_per_node"])
    return max((int(k) for k in preset.get("ranks", {})), default=8)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# -- what is tried --------------------------------------------------------------------------------
def label(strategy: str, layout: Layout, schedule: str) -> str:
    """The strategy's label, and its pipeline where it has one: ``TSP x PP4 1f1b``."""
    own = strategies()[strategy].label(layout)
    return own if layout.pp == 1 else f"{own} x PP{layout.pp} {schedule}"


@dataclass
class Candidate:
    """One runnable (or refused) combination, and what the models say about it."""

    strategy: str
    layout: Layout
    batch: int
    recompute: str
    options: dict[str, Value] = field(default_factory=dict)  # its searched options' values
    microbatches: int = 0  # a pipeline's (0: none)
    pp_schedule: str = ""  # a pipeline's ("": none)
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

    def shown(self, name: str) -> str:
        """A searched option's value as the table shows it ("-": the strategy has no such
        option)."""
        v = self.options.get(name)
        return "-" if v is None else searched()[name].text(v)

    @property
    def result(self) -> dict | None:
        return self.proj or self.bound

    @property
    def tokens_per_s(self) -> float | None:
        return self.result["tokens_per_s"] if self.result else None

    # what a valid candidate has, once modelled (a refused one: none of it, and a ``reason``)
    @property
    def run(self) -> RunSpec:
        """:attr:`spec`, of a valid candidate."""
        assert self.spec is not None, self.reason
        return self.spec

    @property
    def peak_bytes(self) -> float:
        """:attr:`peak`, of a modelled candidate."""
        assert self.peak is not None, self.reason
        return self.peak

    @property
    def speed(self) -> float:
        """:attr:`tokens_per_s` of a modelled candidate."""
        assert self.result is not None, self.reason
        return self.result["tokens_per_s"]


@dataclass
class Config:
    """A strategy's group with one recomputation and one value of each searched option (TSP:
    MLP schedule, KV bucket), over its micro-batches."""

    strategy: str
    layout: Layout
    recompute: str
    options: dict[str, Value] = field(default_factory=dict)
    pp_schedule: str = "1f1b"  # with layout.pp > 1
    candidates: list[Candidate] = field(default_factory=list)
    ops: int | None = None
    bound_ops: int = 0  # operations its bounds charge (a bounded one: its counted twin's)

    @property
    def bounded(self) -> bool:
        """An option whose default dispatches no more (``bounded_by_default``) is not at it:
        its counted twin's operations bound this one's (a KV bucket: the whole group)."""
        opts = searched()
        return any(
            opts[k].bounded_by_default and v != opts[k].default for k, v in self.options.items()
        )

    @property
    def twin(self) -> tuple:
        """What it shares with its twin: all but the bounded options, which are at default."""
        lay, opts = self.layout, searched()
        own = tuple(
            (k, opts[k].default if opts[k].bounded_by_default else v)
            for k, v in self.options.items()
        )
        return (self.strategy, lay.degree, lay.tp, lay.sp, *self.pipeline, self.recompute, own)

    @property
    def pipeline(self) -> tuple[int, str]:
        """(stages, schedule); (1, "") without a pipeline."""
        pp = self.layout.pp
        return (pp, self.pp_schedule if pp > 1 else "")

    @property
    def label(self) -> str:
        return label(self.strategy, self.layout, self.pipeline[1])

    @property
    def valid(self) -> list[Candidate]:
        return [c for c in self.candidates if c.spec is not None]

    @property
    def fitting(self) -> list[Candidate]:
        return [c for c in self.valid if c.fits]

    def best(self) -> Candidate | None:
        """The fitting micro-batch with the most tokens/s, else the one nearest to fitting."""
        if self.fitting:
            return max(self.fitting, key=lambda c: c.speed)
        return min(self.valid, key=lambda c: c.peak_bytes, default=None)

    def bound(self) -> float:
        return max(
            (c.bound["tokens_per_s"] for c in self.fitting if c.bound is not None), default=0.0
        )


# -- what is answered -----------------------------------------------------------------------------
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
