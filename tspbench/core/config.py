"""Model configurations: dataclass presets, any field overridable, validated with clear errors."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


class ConfigError(ValueError):
    """Bad user input: the message names the field, the value and the rule (CLI exit code 2)."""


# Every field's range, shared by --set, configs and presets (workflows/schemas/config.schema.yaml
# must agree; a test checks it): large enough for any real model, small enough that a typo
# (vocab=2e9) is refused instead of allocated.
RANGES: dict[str, tuple[float, float]] = {
    "vocab": (1, 2**20),
    "hidden": (1, 65536),
    "layers": (1, 1024),
    "heads": (1, 1024),
    "kv_heads": (1, 1024),
    "ffn": (1, 2**20),
    "rope_theta": (1e-6, 1e9),
    "norm_eps": (1e-12, 0.1),
    "init_std": (1e-6, 10.0),
}


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class ModelConfig:
    """A dense decoder-only Llama-style model (RMSNorm, RoPE, GQA attention, SwiGLU MLP)."""

    name: str = "custom"
    vocab: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 8
    kv_heads: int = 8
    ffn: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for f, (lo, hi) in RANGES.items():
            v = getattr(self, f)
            integral = f not in ("rope_theta", "norm_eps", "init_std")
            if integral and (not isinstance(v, int) or isinstance(v, bool)):
                raise ConfigError(f"model.{f}={v!r}: must be an integer")
            if not isinstance(v, int | float) or not math.isfinite(v) or not lo <= v <= hi:
                raise ConfigError(f"model.{f}={v!r}: must be between {_num(lo)} and {_num(hi)}")
        if self.hidden % self.heads:
            raise ConfigError(
                f"model.hidden={self.hidden}: must be divisible by model.heads={self.heads}"
            )
        if self.heads % self.kv_heads:
            raise ConfigError(
                f"model.kv_heads={self.kv_heads}: must divide model.heads={self.heads} (GQA)"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head dim hidden/heads={self.head_dim}: must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """h_kv = n_kv * d."""
        return self.kv_heads * self.head_dim

    def n_params(self, embeddings: bool = True) -> int:
        """Total parameter count (embedding and LM head are untied)."""
        h, f = self.hidden, self.ffn
        per_layer = 2 * h * h + 2 * h * self.kv_dim + 3 * h * f + 2 * h
        return self.layers * per_layer + h + (2 * self.vocab * h if embeddings else 0)


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(name="tiny", vocab=256, hidden=64, layers=2, heads=8, kv_heads=8, ffn=128),
    "small": ModelConfig(
        name="small", vocab=4096, hidden=256, layers=4, heads=8, kv_heads=8, ffn=1024
    ),
    "7b": ModelConfig(
        name="7b", vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=32, ffn=16384
    ),
}


def parse_overrides(items: list[str] | None) -> dict[str, object]:
    """Parse ``field=value`` strings (from ``--set``) into typed overrides."""
    fields = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    out: dict[str, object] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected field=value, e.g. --set kv_heads=4")
        key, raw = item.split("=", 1)
        key = key.strip()
        if key not in fields or key == "name":
            raise ConfigError(
                f"--set {key!r}: unknown model field; known: {', '.join(sorted(fields))}"
            )
        kind = fields[key]
        try:
            out[key] = float(raw) if kind == "float" else int(raw)
        except ValueError:
            raise ConfigError(f"--set {key}={raw!r}: must be a {kind}") from None
    return out


def get_config(preset: str, **overrides: object) -> ModelConfig:
    """A preset with fields overridden; unknown preset or field is a ConfigError."""
    if preset not in PRESETS:
        raise ConfigError(f"model={preset!r}: unknown preset; known: {', '.join(PRESETS)}")
    if overrides:
        return dataclasses.replace(PRESETS[preset], **overrides)
    return PRESETS[preset]
