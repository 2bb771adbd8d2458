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
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from tspbench.core.config import ConfigError, ModelConfig, get_config, parse_overrides
from tspbench.core.strategy import Layout, Strategy
from tspbench.runtime.registry import get_strategy

BYTES = {"fp32": 4, "bf16": 2}
CHOICES = {"mode": ("train", "infer"), "dtype": tuple(BYTES), "recompute": ("none", "full")}


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


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """Everything that defines one run: validated on construction, before any process starts."""

    strategy: str
    cfg: ModelConfig
    layout: Layout = Layout()
    seq_len: int
    batch: int = 1  # micro-batch of one model replica; the global batch is batch x dp
    mode: str = "train"  # train | infer
    dtype: str = "fp32"
    recompute: str = "none"
    overlap: bool = True
    kv_bucket: int = 0
    seed: int = 0
    warmup: int = 1
    steps: int = 3
    max_memory: int | None = None
    quiet: bool = False

    def __post_init__(self) -> None:
        for field, choices in CHOICES.items():
            if getattr(self, field) not in choices:
                value = getattr(self, field)
                raise ConfigError(f"{field}={value!r}: must be one of {', '.join(choices)}")
        self.impl.validate(
            self.cfg, self.layout, self.seq_len, self.batch, kv_bucket=self.kv_bucket
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
        **fields: Any,
    ) -> RunSpec:
        """A spec from the strategy's own reading of degree, T x Sigma and replicas."""
        layout = get_strategy(strategy).make_layout(degree, tp, sp, dp)
        return cls(strategy=strategy, cfg=cfg, layout=layout, **fields)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunSpec:
        """From ``tspbench run``'s arguments (ConfigError names the field and the rule)."""
        return cls.make(
            args.strategy,
            get_config(args.model, **parse_overrides(args.set)),
            degree=args.degree,
            tp=args.tp,
            sp=args.sp,
            dp=args.dp,
            seq_len=args.seq_len,
            batch=args.batch,
            mode=args.mode,
            dtype=args.dtype,
            recompute=args.recompute,
            overlap=args.overlap == "on",
            kv_bucket=args.kv_bucket,
            seed=args.seed,
            warmup=args.warmup,
            steps=args.steps,
            max_memory=args.max_memory,
            quiet=getattr(args, "quiet", False),
        )

    def to_argv(self) -> list[str]:
        """``tspbench run`` arguments that rebuild this spec (launcher and output apart)."""
        lay = self.layout
        argv = ["--strategy", self.strategy, "--model", self.cfg.name]
        preset = get_config(self.cfg.name) if self.cfg.name != "custom" else None
        for f in dataclasses.fields(self.cfg):
            value = getattr(self.cfg, f.name)
            if f.name != "name" and (preset is None or getattr(preset, f.name) != value):
                argv += ["--set", f"{f.name}={value}"]
        argv += ["--seq-len", str(self.seq_len), "--degree", str(lay.degree)]
        for key, value in self.impl.factors(lay).items():
            if value is not None:
                argv += [f"--{key}", str(value)]
        argv += ["--dp", str(lay.dp), "--batch", str(self.batch), "--mode", self.mode]
        argv += ["--dtype", self.dtype, "--recompute", self.recompute]
        argv += ["--overlap", "on" if self.overlap else "off", "--kv-bucket", str(self.kv_bucket)]
        argv += ["--seed", str(self.seed), "--warmup", str(self.warmup), "--steps", str(self.steps)]
        if self.max_memory is not None:
            argv += ["--max-memory", str(self.max_memory)]
        return argv + (["--quiet"] if self.quiet else [])

    def replace(self, **changes: Any) -> RunSpec:
        return dataclasses.replace(self, **changes)

    # -- names ------------------------------------------------------------------------------------
    @property
    def label(self) -> str:
        """Strategy and factorisation as tables spell it, e.g. ``tpsp (2x2)``."""
        return self.impl.label(self.layout)

    @property
    def id(self) -> str:
        """The cell id: ``tag.D<degree>.g<GPUs>.S<seq>.B<batch>.<mode>``."""
        lay = self.layout
        return (
            f"{self.impl.tag(lay)}.D{lay.degree}.g{lay.world_size}.S{self.seq_len}"
            f".B{self.batch}.{self.mode}"
        )

    def header(self, launcher: str, world: int) -> dict[str, Any]:
        """The inputs part of a run record."""
        lay = self.layout
        return {
            "strategy": self.strategy,
            "model": self.cfg.name,
            "seq_len": self.seq_len,
            "degree": lay.degree,
            **self.impl.factors(lay),
            "dp": lay.dp,
            "world_size": world,
            "mode": self.mode,
            "batch": self.batch,
            "global_batch": self.batch * lay.dp,
            "dtype": self.dtype,
            "warmup": self.warmup,
            "steps": self.steps,
            "seed": self.seed,
            "max_memory": self.max_memory,
            "recompute": self.recompute,
            "overlap": self.overlap,
            "kv_bucket": self.kv_bucket,
            "model_config": dataclasses.asdict(self.cfg),
            "launcher": launcher,
        }

    # -- what the closed forms read ---------------------------------------------------------------
    @cached_property
    def impl(self) -> type[Strategy]:
        return get_strategy(self.strategy)

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
