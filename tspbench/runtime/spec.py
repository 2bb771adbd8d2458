"""One run, described once: :class:`RunSpec`.

The command line builds it (:meth:`RunSpec.from_args`), a launcher turns it back into arguments
(:meth:`RunSpec.to_argv`), the record starts from it (:meth:`RunSpec.header`), and the analytic
model, the estimator, the cost model, the pipeline's cells and the tests all take it. What
depends on the strategy (its layout, label, context-parallel degree) is asked of the strategy.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from tspbench.core.config import ConfigError, ModelConfig, load_model, model_with_overrides
from tspbench.core.dtypes import BYTES
from tspbench.core.mesh import Axis
from tspbench.core.options import Options, Value
from tspbench.core.strategy import Layout, Strategy
from tspbench.runtime.pipelined import check as check_pipeline
from tspbench.runtime.registry import all_options, get_strategy, strategies, takers

CHOICES = {
    "mode": ("train", "infer", "decode", "generate"),
    "dtype": tuple(BYTES),
    "recompute": ("none", "full"),
}

DECODE_MODES = ("decode", "generate")  # prefill, then one token per step (docs/decode.md)
DEFAULT_NEW_TOKENS = 16


def parse_size(text: str) -> int:
    """'512M', '2G', '1.5GiB', '1000000' -> bytes (ValueError saying what is expected)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"{text!r}: expected a size such as 512M or 2G")
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2).upper()]
    value = int(float(m.group(1)) * scale)
    if value <= 0:
        raise ValueError(f"{text!r}: must be positive")
    return value


# tspbench/schemas/record.schema.json's version: bump it when a key changes meaning or goes
RECORD_SCHEMA_VERSION = 1


MEASURE_FIELDS = ("seed", "warmup", "steps", "max_memory", "quiet")  # only a measured run's


def experts_tag(cfg: ModelConfig) -> str:
    """``-e8k2`` for a model with 8 experts, 2 per token (its cells beside a dense model's
    keep ids of their own), else nothing."""
    return f"-e{cfg.experts}k{cfg.top_k}" if cfg.moe else ""


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """Everything that defines one run: validated on construction, before any process starts."""

    strategy: str
    cfg: ModelConfig
    layout: Layout = Layout()
    seq_len: int
    batch: int = 1  # micro-batch of one model replica; the global batch is batch x dp
    mode: str = "train"  # train | infer | decode | generate
    new_tokens: int = 0  # decode, generate: tokens generated per sequence
    dtype: str = "fp32"
    recompute: str = "none"
    options: Mapping[str, Value] = field(default_factory=dict)  # the strategy's own: Options
    pp_schedule: str = "1f1b"  # with layout.pp > 1: torch.distributed.pipelining's schedule
    microbatches: int = 0  # with layout.pp > 1: micro-batches the schedule splits batch into
    # (0: pp, the fewest 1F1B takes)
    stage_of: int = 0  # a closed form's whole-model spec standing for one stage's work on one
    # micro-batch (tspbench.projection.stages.micro_spec): the pipeline's pp; 0: not a stage
    seed: int = 0
    warmup: int = 1
    steps: int = 3
    max_memory: int | None = None
    quiet: bool = False

    def __post_init__(self) -> None:
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                value = getattr(self, name)
                raise ConfigError(f"{name}={value!r}: must be one of {', '.join(choices)}")
        options = Options(self.impl.options, self.options, self.strategy)  # defaults filled in
        object.__setattr__(self, "options", options)
        lay = self.layout
        if not self.microbatches:
            object.__setattr__(self, "microbatches", lay.pp)
        if lay.pp > 1 and self.mode not in ("train", "infer"):
            raise ConfigError(f"mode={self.mode!r} with pp={lay.pp}: pipelines here train or infer")
        for o in self.impl.options:
            if not o.applies(lay.pp, self.cfg.moe) and not self.stage_of:
                if options[o.name] != o.default:
                    value = o.text(options[o.name])
                    raise ConfigError(f"{o.name}={value}: {o.why_not(lay.pp, self.cfg.moe)}")
        if self.decoding:
            if self.recompute != "none":
                raise ConfigError(
                    f"recompute={self.recompute!r}: --mode {self.mode} runs no backward, so "
                    "nothing is recomputed (leave it none)"
                )
            if self.impl.decoder is None:
                can = ", ".join(n for n, s in strategies().items() if s.decoder is not None)
                raise ConfigError(
                    f"mode={self.mode!r}: strategy {self.strategy} has no decode path "
                    f"(strategies that decode: {can})"
                )
            self.impl.validate_decode(
                self.cfg, self.layout, self.seq_len, self.new_tokens, self.batch, **options
            )
            return
        if self.new_tokens:
            raise ConfigError(
                f"new_tokens={self.new_tokens}: only --mode {' or '.join(DECODE_MODES)} generates"
            )
        self.impl.validate(self.cfg, self.layout, self.seq_len, self.batch, **options)
        check_pipeline(
            lay.pp,
            self.pp_schedule,
            self.microbatches,
            self.batch,
            self.cfg.layers,
            self.train,
            self.impl,
        )

    @classmethod
    def make(
        cls,
        strategy: str,
        cfg: ModelConfig,
        *,
        degree: int | None = None,
        tp: int = 1,
        sp: int = 1,
        dp: int = 1,
        pp: int = 1,
        **fields: Any,
    ) -> RunSpec:
        """A spec from the strategy's own reading of degree, T x Sigma and replicas, with ``pp``
        pipeline stages; ``fields`` that are not the spec's are the strategy's options."""
        layout = dataclasses.replace(get_strategy(strategy).make_layout(degree, tp, sp, dp), pp=pp)
        fields, options = _split(fields, {})
        return cls(strategy=strategy, cfg=cfg, layout=layout, options=options, **fields)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunSpec:
        """From ``tspbench run``'s arguments (ConfigError names the field and the rule); an
        option the strategy does not declare is refused, not recorded as if it meant something."""
        known = all_options()
        named = {k: getattr(args, k) for k in known if getattr(args, k, None) is not None}
        for name in named.keys() - {o.name for o in get_strategy(args.strategy).options}:
            who = takers(name)
            raise ConfigError(
                f"{known[name].flag}: strategy {args.strategy} takes no such option "
                f"({', '.join(who)} take{'s' if len(who) == 1 else ''} it)"
            )
        return cls.make(
            args.strategy,
            model_with_overrides(args.model, args.set),
            degree=args.degree,
            tp=args.tp,
            sp=args.sp,
            dp=args.dp,
            pp=getattr(args, "pp", 1),
            **_schedule_of(args),
            seq_len=args.seq_len,
            batch=args.batch,
            mode=args.mode,
            new_tokens=(
                args.new_tokens
                if getattr(args, "new_tokens", None) is not None
                else DEFAULT_NEW_TOKENS * (args.mode in DECODE_MODES)
            ),
            dtype=args.dtype,
            recompute=args.recompute,
            options=named,
            **{k: getattr(args, k) for k in MEASURE_FIELDS if hasattr(args, k)},
        )

    def to_argv(self) -> list[str]:
        """``tspbench run`` arguments that rebuild this spec (launcher and output apart)."""
        lay = self.layout
        argv = ["--strategy", self.strategy, "--model", self.cfg.name]
        preset = load_model(self.cfg.name)[0] if self.cfg.name != "custom" else None
        for f in dataclasses.fields(self.cfg):
            value = getattr(self.cfg, f.name)
            if f.name != "name" and (preset is None or getattr(preset, f.name) != value):
                argv += ["--set", f"{f.name}={value}"]
        argv += ["--seq-len", str(self.seq_len), "--degree", str(lay.degree)]
        for key, value in self.impl.factors(lay).items():
            if value is not None:
                argv += [f"--{key}", str(value)]
        argv += ["--dp", str(lay.dp), "--batch", str(self.batch), "--mode", self.mode]
        if lay.pp > 1:
            argv += ["--pp", str(lay.pp), "--pp-schedule", self.pp_schedule]
            argv += ["--microbatches", str(self.microbatches)]
        if self.decoding:
            argv += ["--new-tokens", str(self.new_tokens)]
        argv += ["--dtype", self.dtype, "--recompute", self.recompute]
        for o in self.impl.options:  # each named (``project`` would pick the preset's), but
            if not o.applies(lay.pp, self.cfg.moe):  # those that do nothing here (no stages,
                # no experts)
                continue
            argv += [o.flag, o.text(self.options[o.name])]
        argv += ["--seed", str(self.seed), "--warmup", str(self.warmup), "--steps", str(self.steps)]
        if self.max_memory is not None:
            argv += ["--max-memory", str(self.max_memory)]
        return argv + (["--quiet"] if self.quiet else [])

    def preset_options(self, preset: dict[str, Any], named: Collection[str] = ()) -> RunSpec:
        """With the options its strategy chooses from the preset's facts (its topology), but
        those the user ``named``: what ``tspbench project`` and the projected tables use."""
        chosen = self.impl.preset_options(preset)
        return self.replace(**{k: v for k, v in chosen.items() if k not in named})

    def replace(self, **changes: Any) -> RunSpec:
        """A copy with ``changes``; those that are not the spec's fields are options (another
        strategy starts from its own defaults)."""
        changes, options = _split(changes, {} if "strategy" in changes else self.options)
        return dataclasses.replace(self, options=options, **changes)

    # -- names ------------------------------------------------------------------------------------
    @property
    def label(self) -> str:
        """Strategy and factorisation as tables spell it, e.g. ``tpsp (2x2)``."""
        return self.impl.label(self.layout) + self._options.suffix("label")

    @property
    def tag(self) -> str:
        """The strategy and its factorisation as cell ids spell it, and a schedule other than
        the default: ``tsp-mlp-broadcast``, ``tsp-kvsave``."""
        return (
            self.impl.tag(self.layout)
            + experts_tag(self.cfg)
            + self._options.suffix("tag")
            + self._pipeline_tag
        )

    @property
    def _pipeline_tag(self) -> str:
        """``-pp2-1f1b-m4`` for a pipelined run, else nothing."""
        if self.layout.pp == 1:
            return ""
        return f"-pp{self.layout.pp}-{self.pp_schedule}-m{self.microbatches}"

    @property
    def _options(self) -> Options:
        """``options`` as construction leaves it: an :class:`Options`, every default filled in."""
        assert isinstance(self.options, Options)
        return self.options

    @property
    def id(self) -> str:
        """The cell id: ``tag.D<degree>.g<GPUs>.S<seq>.B<batch>.<mode>``."""
        lay = self.layout
        return (
            f"{self.tag}.D{lay.degree}.g{lay.world_size}.S{self.seq_len}.B{self.batch}.{self.mode}"
        ) + (f".N{self.new_tokens}" if self.decoding else "")

    def header(self, launcher: str, world: int) -> dict[str, Any]:
        """The inputs part of a run record."""
        lay = self.layout
        return {
            "schema_version": RECORD_SCHEMA_VERSION,
            "strategy": self.strategy,
            "model": self.cfg.name,
            "seq_len": self.seq_len,
            "degree": lay.degree,
            **self.impl.factors(lay),
            "dp": lay.dp,
            **(
                {"pp": lay.pp, "pp_schedule": self.pp_schedule, "microbatches": self.microbatches}
                if lay.pp > 1
                else {}
            ),
            "world_size": world,
            "mode": self.mode,
            **({"new_tokens": self.new_tokens} if self.decoding else {}),
            "batch": self.batch,
            "global_batch": self.batch * lay.dp,
            "dtype": self.dtype,
            "warmup": self.warmup,
            "steps": self.steps,
            "seed": self.seed,
            "max_memory": self.max_memory,
            "recompute": self.recompute,
            # every strategy's options: the run's, else unused at the declared default
            **{k: self.options.get(k, o.default) for k, o in all_options().items()},
            "model_config": dataclasses.asdict(self.cfg),
            "launcher": launcher,
        }

    # -- what the closed forms read ---------------------------------------------------------------
    @cached_property
    def impl(self) -> type[Strategy]:
        return get_strategy(self.strategy)

    @property
    def mesh_dims(self) -> dict[str, int]:
        """The run's mesh axes, outermost first: the pipeline's stages (where it has them)
        outside the strategy's own."""
        dims = self.impl.mesh_dims(self.layout)
        return {Axis.PP: self.layout.pp, **dims} if self.layout.pp > 1 else dims

    @property
    def degree(self) -> int:
        return self.layout.degree

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def sp(self) -> int:
        return self.layout.sp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def e(self) -> int:
        """Bytes per element of the compute dtype."""
        return BYTES[self.dtype]

    @property
    def train(self) -> bool:
        return self.mode == "train"

    @property
    def decoding(self) -> bool:
        """Prefill then decode steps (``seq_len`` is the prompt length)."""
        return self.mode in DECODE_MODES

    @property
    def rc(self) -> bool:
        """Activation recomputation in effect (training only)."""
        return self.train and self.recompute == "full"

    @property
    def cp(self) -> int:
        """Ranks that split a sequence (zigzag): the context-parallel degree."""
        return self.impl.context_parallel(self.layout)

    @property
    def tokens(self) -> int:
        """Tokens this rank computes on: the replica's share (DP gives ranks whole sequences)."""
        split = self.cp * self.impl.replica_batch(self.layout)
        return self.batch * self.seq_len // split


FIELDS = {f.name for f in dataclasses.fields(RunSpec)}


def _schedule_of(args: argparse.Namespace) -> dict[str, Any]:
    """``--pp-schedule`` and ``--microbatches`` as given (absent: the spec's defaults); named
    without pipeline stages, refused rather than ignored."""
    given = {k: getattr(args, k, None) for k in ("pp_schedule", "microbatches")}
    given = {k: v for k, v in given.items() if v is not None}
    if given and getattr(args, "pp", 1) == 1:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in given)
        raise ConfigError(f"{flags}: only with --pp > 1 (got pp=1)")
    return given


def _split(
    given: dict[str, Any], options: Mapping[str, Value]
) -> tuple[dict[str, Any], dict[str, Value]]:
    """(the spec's fields, ``options`` (or the given ``options``) updated by the rest: the
    strategy's options)."""
    fields = {k: v for k, v in given.items() if k in FIELDS and k != "options"}
    base = given.get("options", options)
    return fields, {**base, **{k: v for k, v in given.items() if k not in FIELDS}}
