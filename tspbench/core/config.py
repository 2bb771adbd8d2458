"""Model configurations: dataclass presets, any field overridable, validated with clear errors."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


class ConfigError(ValueError):
    """Bad user input: the message names the field, the value and the rule (CLI exit code 2)."""


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
        for f in ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"model.{f}={v!r}: must be a positive integer")
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
        if not self.rope_theta > 0 or not self.norm_eps > 0 or not self.init_std > 0:
            raise ConfigError("model.rope_theta, model.norm_eps and model.init_std must be > 0")

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
