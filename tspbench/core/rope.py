"""RoPE frequencies with the context-extension scalings that published configs ship.

Llama 3.1/3.2 ship ``llama3``, Qwen2.5/Qwen3 document ``yarn`` for long contexts, older
long-context fine-tunes ``linear``. Each changes the rotation angles, and so the outputs, but no
shape or cost: the scaling is a property of the tables (:func:`inv_freq`), which every strategy
takes from one place (:func:`tspbench.core.layers.rope_tables`).

A model carries its scaling as one canonical string, ``kind,key=value,...`` (``""``: none), so a
:class:`~tspbench.core.config.ModelConfig` stays flat, hashable and settable by ``--set``. The
formulas are Hugging Face's (``transformers.modeling_rope_utils``), computed in fp64.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where tables are built: configs are read on images without it
    import torch

# kind -> {key: default}; None: the key is required
KINDS: dict[str, dict[str, float | None]] = {
    "linear": {"factor": None},
    "llama3": {
        "factor": None,
        "low_freq_factor": None,
        "high_freq_factor": None,
        "original_max_position_embeddings": None,
    },
    "yarn": {
        "factor": None,
        "original_max_position_embeddings": None,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "attention_factor": 0.0,  # 0: derived from the factor, 0.1 ln(factor) + 1
        "truncate": 1.0,  # 1: the correction range rounded outward, as HF's default
    },
}
# rope_type values published configs use that change positions in a way not modelled here
REFUSED = {
    "dynamic": "dynamic NTK scaling depends on the length seen at run time",
    "longrope": "LongRoPE's per-dimension factors are not modelled",
    "mrope": "multimodal RoPE is not modelled",
}
HF_NEUTRAL = {"rope_type", "type", "rope_theta"}  # keys of HF's dict that are not the scaling's


class RopeError(ValueError):
    """A scaling the tables cannot express (the caller names the field it came from)."""


def parse(text: str) -> tuple[str, dict[str, float]]:
    """(kind, every parameter with its default filled in) of a canonical scaling string;
    ``("", {})`` for none. RopeError naming the part and the rule otherwise. Parsed once per
    string (decode builds tables every step); each caller gets its own dict."""
    kind, values = _parse(text)
    return kind, dict(values)


@functools.lru_cache(maxsize=64)
def _parse(text: str) -> tuple[str, tuple[tuple[str, float], ...]]:
    kind, values = _parse_new(text)
    return kind, tuple(values.items())


def _parse_new(text: str) -> tuple[str, dict[str, float]]:
    if text == "":
        return "", {}
    kind, *parts = text.split(",")
    if kind not in KINDS:
        raise RopeError(f"unknown kind {kind!r} (known: {', '.join(KINDS)}, or empty for none)")
    spec, values = KINDS[kind], {}
    for part in parts:
        key, eq, raw = part.partition("=")
        if not eq or key not in spec or key in values:
            why = "not key=value" if not eq else "repeated" if key in values else "unknown key"
            raise RopeError(f"{part!r}: {why} (keys of {kind}: {', '.join(spec)})")
        try:
            values[key] = float(raw)
        except ValueError:
            raise RopeError(f"{key}={raw!r}: must be a number") from None
        if not math.isfinite(values[key]) or values[key] < 0:
            raise RopeError(f"{key}={raw!r}: must be a finite number >= 0")
    missing = [k for k, d in spec.items() if d is None and k not in values]
    if missing:
        raise RopeError(f"{kind} needs {', '.join(missing)}")
    values = {k: values.get(k, d) for k, d in spec.items()}  # type: ignore[misc]
    _check(kind, values)
    return kind, values


def _check(kind: str, v: dict[str, float]) -> None:
    if v["factor"] < 1:
        raise RopeError(f"factor={v['factor']:g}: must be >= 1 (it stretches the context)")
    if kind == "llama3" and not 0 < v["low_freq_factor"] < v["high_freq_factor"]:
        raise RopeError("llama3 needs 0 < low_freq_factor < high_freq_factor")
    if kind in ("llama3", "yarn") and v["original_max_position_embeddings"] < 1:
        raise RopeError("original_max_position_embeddings: must be >= 1")
    if kind == "yarn" and v["truncate"] not in (0.0, 1.0):
        raise RopeError(f"truncate={v['truncate']:g}: must be 0 or 1")


def canonical(kind: str, values: dict[str, float]) -> str:
    """The canonical string of a scaling (numbers written so that they read back exactly)."""
    if not kind:
        return ""

    def num(v: float) -> str:
        return str(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)

    return ",".join([kind] + [f"{k}={num(values[k])}" for k in KINDS[kind] if k in values])


def from_hf(d: dict) -> str:
    """The canonical string of a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict.
    RopeError naming the key for a kind or a key the tables do not model."""
    kind = d.get("rope_type", d.get("type", "default"))
    if kind in (None, "default"):
        extra = sorted(k for k in d if k not in HF_NEUTRAL and k != "partial_rotary_factor")
        if extra:
            raise RopeError(f"{extra[0]}: a parameter of no scaling (rope_type default)")
        return ""
    if kind in REFUSED:
        raise RopeError(f"rope_type={kind!r}: {REFUSED[kind]}")
    if kind not in KINDS:
        raise RopeError(f"rope_type={kind!r}: unknown (modelled: {', '.join(KINDS)}, default)")
    values: dict[str, float] = {}
    for key, raw in d.items():
        if key in HF_NEUTRAL or (key == "partial_rotary_factor" and raw in (None, 1, 1.0)):
            continue
        if key not in KINDS[kind]:
            raise RopeError(f"{key}={raw!r}: not modelled for rope_type {kind}")
        if raw is None:
            continue  # HF reads null as its default
        if isinstance(raw, bool):
            raw = float(raw)
        if not isinstance(raw, int | float):
            raise RopeError(f"{key}={raw!r}: must be a number")
        values[key] = float(raw)
    text = canonical(kind, values)
    parse(text)  # the rules, said in the same words as for --set
    return text


def inv_freq(scaling: str, head_dim: int, theta: float) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim/2] in fp64, the factor HF multiplies cos and sin by)."""
    import torch

    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    kind, v = parse(scaling)
    if kind == "linear":
        return inv / v["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv, v), 1.0
    if kind == "yarn":
        return _yarn(inv, v, head_dim, theta)
    return inv, 1.0


def _llama3(inv: torch.Tensor, v: dict[str, float]) -> torch.Tensor:
    """Llama 3.1's: long wavelengths divided by the factor, short kept, a smooth ramp between."""
    old, factor = v["original_max_position_embeddings"], v["factor"]
    low_wavelen, high_wavelen = old / v["low_freq_factor"], old / v["high_freq_factor"]
    wavelen = 2 * math.pi / inv
    import torch

    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - v["low_freq_factor"]) / (v["high_freq_factor"] - v["low_freq_factor"])
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(
    inv: torch.Tensor, v: dict[str, float], head_dim: int, theta: float
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolation for the dimensions that rotate fewer than ``beta_slow`` times over the
    original context, extrapolation above ``beta_fast``, a linear ramp between; cos and sin
    scaled by the attention factor."""
    factor, orig = v["factor"], v["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(v["beta_fast"]), dim_of(v["beta_slow"])
    if v["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high  # HF's guard against a zero-width ramp
    import torch

    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    out = (inv / factor) * (1 - extrapolated) + inv * extrapolated
    attention = v["attention_factor"] or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return out, attention
