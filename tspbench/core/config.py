"""Model configurations: dataclass presets, any field overridable, validated with clear errors."""

from __future__ import annotations

import dataclasses
import math
import os
import stat
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack, cast

from tspbench.core import rope


class ConfigError(ValueError):
    """Bad user input: the message names the field, the value and the rule (CLI exit code 2)."""


MAX_INPUT_BYTES = 256 * 2**20  # an aggregate table of a large sweep is a few MB


def _named(what: str, path: str | os.PathLike) -> str:
    """``--summary='x.csv'`` for an option, ``record 'x.json'`` for anything else."""
    return f"{what}={str(path)!r}" if what.startswith("--") else f"{what} {str(path)!r}"


def read_input(path: str | os.PathLike, what: str, max_bytes: int = MAX_INPUT_BYTES) -> str:
    """The text of a file the user named (JSON, CSV, YAML), or one ConfigError naming it: a
    FIFO would block forever, /dev/zero read until memory runs out, a binary file fail deep
    inside a parser."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{_named(what, path)}: not a regular file")
        if info.st_size > max_bytes:
            raise ConfigError(f"{_named(what, path)}: larger than {max_bytes} bytes")
        with open(path, encoding="utf-8") as f:
            return f.read(max_bytes + 1)[:max_bytes]
    except OSError as e:
        raise ConfigError(f"{_named(what, path)}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{_named(what, path)}: not a text file") from None


def read_json_input(path: str | os.PathLike, what: str, max_bytes: int = 2**20, **kw) -> Any:
    """A JSON document the user named, through :func:`read_input` (``kw``: json.loads's)."""
    import json

    text = read_input(path, what, max_bytes)
    try:
        return json.loads(text, **kw)
    except (ValueError, RecursionError) as e:  # RecursionError: [[[[...]]]] thousands deep
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{_named(what, path)}: not valid JSON ({first})") from None


def read_csv_input(path: str | os.PathLike, what: str):
    """A CSV table the user named, as a DataFrame, through :func:`read_input` (pandas is
    imported here, not at the top: the core runs on images without it)."""
    import io

    import pandas as pd

    text = read_input(path, what)
    try:
        return pd.read_csv(io.StringIO(text))
    except ValueError as e:  # pandas' EmptyDataError and ParserError included
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{_named(what, path)}: not a CSV table ({first})") from None


# Every field's range, shared by --set, configs and presets (tspbench/schemas/config.schema.yaml
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
    "head_dim": (0, 4096),  # 0: hidden/heads
    "experts": (0, 4096),  # 0: a dense MLP
    "top_k": (0, 4096),
    "expert_ffn": (0, 2**20),  # 0: ffn
    "shared_ffn": (0, 2**20),  # 0: no shared expert
    "aux_loss": (0.0, 1.0),
}
FLOATS = ("rope_theta", "norm_eps", "init_std", "aux_loss")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Llama-style model (RMSNorm, RoPE, GQA attention, SwiGLU MLP), dense or
    with a dropless mixture of experts in every layer's MLP (Mixtral, Qwen2/3-MoE:
    tspbench/core/moe.py)."""

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
    rope_scaling: str = ""  # "kind,key=value,..." (tspbench/core/rope.py); "": none
    qk_norm: bool = False  # RMSNorm over each head's Q and K before RoPE (Qwen3)
    qkv_bias: bool = False  # biases on the Q, K and V projections (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # a bias on W_o's output (Llama's and Qwen3's attention_bias)
    mlp_bias: bool = False  # biases on W1, W3 and W2 (Llama's mlp_bias)
    tie_embeddings: bool = False  # the LM head is the embedding (Llama 3.2 1B/3B, small Qwens)
    head_dim: int = 0  # each head's size d; 0: hidden/heads (Qwen3 0.6B/4B/32B set it wider)
    experts: int = 0  # E routed experts per layer; 0: a dense MLP
    top_k: int = 0  # experts per token (num_experts_per_tok)
    expert_ffn: int = 0  # each expert's f_e (Qwen's moe_intermediate_size); 0: ffn (Mixtral)
    norm_topk: bool = True  # the k weights renormalised to 1 (Mixtral; Qwen: norm_topk_prob)
    shared_ffn: int = 0  # a gated shared expert's width (Qwen2-MoE); 0: none
    aux_loss: float = 0.0  # the load-balancing loss's coefficient (router_aux_loss_coef); 0: off

    def __post_init__(self) -> None:
        for f, (lo, hi) in RANGES.items():
            v = getattr(self, f)
            integral = f not in FLOATS
            if integral and (not isinstance(v, int) or isinstance(v, bool)):
                raise ConfigError(f"model.{f}={v!r}: must be an integer")
            if isinstance(v, bool):
                raise ConfigError(f"model.{f}={v!r}: must be a number")
            if not isinstance(v, int | float) or not math.isfinite(v) or not lo <= v <= hi:
                raise ConfigError(f"model.{f}={v!r}: must be between {_num(lo)} and {_num(hi)}")
        if self.head_dim == 0 and self.hidden % self.heads:
            raise ConfigError(
                f"model.hidden={self.hidden}: must be divisible by model.heads={self.heads}"
                " (or model.head_dim set)"
            )
        if self.heads % self.kv_heads:
            raise ConfigError(
                f"model.kv_heads={self.kv_heads}: must divide model.heads={self.heads} (GQA)"
            )
        if self.d_head % 2:
            what = "model.head_dim" if self.head_dim else "head dim hidden/heads"
            raise ConfigError(f"{what}={self.d_head}: must be even for RoPE")
        self._check_experts()
        for flag in ("qk_norm", "qkv_bias", "o_bias", "mlp_bias", "tie_embeddings", "norm_topk"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"model.{flag}={getattr(self, flag)!r}: must be true or false")
        if not isinstance(self.rope_scaling, str):
            raise ConfigError(f"model.rope_scaling={self.rope_scaling!r}: must be a string")
        try:
            rope.parse(self.rope_scaling)
        except rope.RopeError as e:
            raise ConfigError(f"model.rope_scaling={self.rope_scaling!r}: {e}") from None

    def _check_experts(self) -> None:
        """The mixture-of-experts fields agree: k experts of E per token, the MoE fields only
        with experts, no dense MLP biases in an MoE layer."""
        if not self.experts:
            for f in ("top_k", "expert_ffn", "shared_ffn", "aux_loss"):
                if getattr(self, f):
                    raise ConfigError(
                        f"model.{f}={getattr(self, f)!r}: only with experts (model.experts=0)"
                    )
            if self.norm_topk is not True:  # (its default: the field means nothing here)
                raise ConfigError(
                    f"model.norm_topk={self.norm_topk!r}: only with experts (model.experts=0)"
                )
            return
        if not 1 <= self.top_k <= self.experts:
            raise ConfigError(
                f"model.top_k={self.top_k}: must be between 1 and model.experts={self.experts}"
            )
        if self.mlp_bias:
            raise ConfigError("model.mlp_bias=True: an MoE layer's experts have no biases")

    @property
    def moe(self) -> bool:
        """Whether each layer's MLP is a mixture of experts."""
        return self.experts > 0

    @property
    def moe_ffn(self) -> int:
        """f_e, each routed expert's width: ``expert_ffn`` where set, ``ffn`` otherwise."""
        return self.expert_ffn or self.ffn

    @property
    def d_head(self) -> int:
        """d: ``head_dim`` where set, hidden/heads otherwise (HF's default)."""
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """h_q = n_h * d: Q's width and W_o's input, h unless ``head_dim`` widens it."""
        return self.heads * self.d_head

    @property
    def kv_dim(self) -> int:
        """h_kv = n_kv * d."""
        return self.kv_heads * self.d_head

    def n_params(self, embeddings: bool = True) -> int:
        """Total parameter count (embedding and LM head are untied)."""
        h, f, q = self.hidden, self.ffn, self.q_dim
        mlp = 3 * h * f
        if self.moe:  # the router, E experts and a shared expert with its gate
            mlp = self.experts * (h + 3 * h * self.moe_ffn)
            mlp += (3 * h * self.shared_ffn + h) if self.shared_ffn else 0
        per_layer = 2 * h * q + 2 * h * self.kv_dim + mlp + 2 * h
        per_layer += 2 * self.d_head if self.qk_norm else 0
        per_layer += q + 2 * self.kv_dim if self.qkv_bias else 0
        per_layer += h if self.o_bias else 0
        per_layer += 2 * f + h if self.mlp_bias else 0
        tables = 1 if self.tie_embeddings else 2  # the embedding, and an untied head
        return self.layers * per_layer + h + (tables * self.vocab * h if embeddings else 0)


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(name="tiny", vocab=256, hidden=64, layers=2, heads=8, kv_heads=8, ffn=128),
    "small": ModelConfig(
        name="small", vocab=4096, hidden=256, layers=4, heads=8, kv_heads=8, ffn=1024
    ),
    "7b": ModelConfig(
        name="7b", vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=32, ffn=16384
    ),
    # well-known shapes (planning): Llama-3-8B's GQA (8 KV heads) and a Llama-2-13B-like MHA
    "llama3-8b": ModelConfig(
        name="llama3-8b", vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8,
        ffn=14336, rope_theta=500000.0,
    ),
    "llama2-13b": ModelConfig(
        name="llama2-13b", vocab=32000, hidden=5120, layers=40, heads=40, kv_heads=40, ffn=13824
    ),
}  # fmt: skip


class ModelOverrides(TypedDict, total=False):
    """The fields of a :class:`ModelConfig` that ``--set`` or a config may override."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rope_theta: float
    norm_eps: float
    init_std: float
    rope_scaling: str
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_embeddings: bool
    head_dim: int
    experts: int
    top_k: int
    expert_ffn: int
    norm_topk: bool
    shared_ffn: int
    aux_loss: float


BOOLS = {"true": True, "false": False, "1": True, "0": False}


def parse_overrides(items: list[str] | None) -> ModelOverrides:
    """Parse ``field=value`` strings (from ``--set``) into typed overrides."""
    fields = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    out: dict[str, int | float | str | bool] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected field=value, e.g. --set kv_heads=4")
        key, raw = item.split("=", 1)
        key = key.strip()
        if key in HF_CAPACITY_KEYS:
            raise ConfigError(
                f"--set {key}={raw}: the MoE here is dropless (every routed token is computed):"
                " no capacity"
            )
        if key not in fields or key == "name":
            raise ConfigError(
                f"--set {key!r}: unknown model field; known: {', '.join(sorted(fields))}"
            )
        kind = fields[key]
        if kind == "bool":
            if raw.strip().lower() not in BOOLS:
                raise ConfigError(f"--set {key}={raw!r}: must be true or false")
            out[key] = BOOLS[raw.strip().lower()]
            continue
        try:
            out[key] = float(raw) if kind == "float" else raw if kind == "str" else int(raw)
        except ValueError:
            what = {"int": "an integer", "float": "a number"}.get(str(kind), f"a {kind}")
            raise ConfigError(f"--set {key}={raw!r}: must be {what}") from None
    return cast(ModelOverrides, out)  # keys checked against the fields, values typed by kind


def get_config(preset: str, **overrides: Unpack[ModelOverrides]) -> ModelConfig:
    """A preset with fields overridden; unknown preset or field is a ConfigError."""
    if preset not in PRESETS:
        raise ConfigError(f"model={preset!r}: unknown preset; known: {', '.join(PRESETS)}")
    if overrides:
        return dataclasses.replace(PRESETS[preset], **overrides)
    return PRESETS[preset]


# -- Hugging Face config.json (shapes only; nothing is downloaded) ---------------------------------
HF_FIELDS = {  # ModelConfig field <- config.json key (and the key's default, None: required)
    "vocab": ("vocab_size", None),
    "hidden": ("hidden_size", None),
    "layers": ("num_hidden_layers", None),
    "heads": ("num_attention_heads", None),
    "kv_heads": ("num_key_value_heads", "num_attention_heads"),  # missing: MHA
    "ffn": ("intermediate_size", None),
    "rope_theta": ("rope_theta", 10000.0),
    "norm_eps": ("rms_norm_eps", 1e-6),
}
# pre-norm RMSNorm/RoPE/GQA/SwiGLU decoders (docs/models.md); Qwen3 adds QK norms; Mixtral and
# Qwen2/3-MoE route each layer's tokens to experts (tspbench/core/moe.py)
HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
HF_FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3", "Mixtral", "Qwen2Moe", "Qwen3Moe")
HF_ARCHS = {
    f"{n}{h}": t for n, t in zip(HF_FAMILIES, HF_MODEL_TYPES) for h in ("ForCausalLM", "Model")
}
QK_NORM_TYPES = ("qwen3", "qwen3_moe")  # Qwen3 norms each head's Q and K
QKV_BIAS_TYPES = ("qwen2",)  # Qwen2 (and 2.5) has biases on its Q, K, V projections
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
HF_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "n_shared_experts",
               "num_experts_per_tok", "moe_intermediate_size", "moe_layer_freq",
               "shared_expert_intermediate_size", "decoder_sparse_step")  # fmt: skip
# the keys of a capacity that drops tokens (Switch, Megatron-Core): the MoE here is dropless
HF_CAPACITY_KEYS = ("capacity_factor", "expert_capacity", "moe_expert_capacity_factor")


def hf_config(data: object, where: str = "config.json") -> tuple[ModelConfig, list[str]]:
    """A :class:`ModelConfig` from a Hugging Face Llama-style ``config.json`` (a dict), and notes
    on the keys read that change nothing here (:func:`_hf_notes`). Whatever the model here
    cannot express (mixture of experts, sliding-window attention, another architecture or
    activation) is a ConfigError naming the key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be a JSON object of model settings")
    _hf_check_architecture(data, where)
    values = _hf_values(data, where)
    _hf_head_dim(data, where, values)
    values["rope_scaling"] = _hf_rope(data, where, values)
    archs = data.get("architectures") or []
    family = data.get("model_type") or (HF_ARCHS[archs[0]] if archs else "")  # its model_type
    values["qk_norm"] = family in QK_NORM_TYPES
    values.update(_hf_biases(data, where, family or "llama"))
    if family in MOE_TYPES:
        values.update(_hf_experts(data, where, family))
    tie = data.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise _hf_refuse(data, where, "tie_word_embeddings", "must be true or false")
    values["tie_embeddings"] = tie
    return _hf_model(values, where, family), _hf_notes(data)


def _hf_notes(data: dict) -> list[str]:
    """The keys read that change nothing here, each named with why: the dtype (``--dtype``
    sets it), the trained context (``--seq-len`` is not held to it), attention dropout (the
    step runs without dropout) and Llama 2's ``pretraining_tp`` (HF's sliced emulation of the
    same linear layers)."""
    notes = []
    for key in ("torch_dtype", "dtype"):
        if isinstance(data.get(key), str):
            notes.append(f"{key}={data[key]}: not read as the dtype (--dtype sets it)")
    if isinstance(data.get("max_position_embeddings"), int):
        notes.append(
            f"max_position_embeddings={data['max_position_embeddings']}: the context it was "
            "trained to; --seq-len is not held to it"
        )
    dropout = data.get("attention_dropout")
    if isinstance(dropout, int | float) and not isinstance(dropout, bool) and dropout:
        notes.append(f"attention_dropout={dropout}: not modelled (the step has no dropout)")
    jitter = data.get("router_jitter_noise")
    if isinstance(jitter, int | float) and not isinstance(jitter, bool) and jitter:
        notes.append(f"router_jitter_noise={jitter}: not modelled (the step has no noise)")
    coef = data.get("router_aux_loss_coef")
    if coef and not data.get("output_router_logits"):
        notes.append(
            f"router_aux_loss_coef={coef}: HF adds it only with output_router_logits; off here"
            f" (--set aux_loss={coef} turns it on)"
        )
    tp = data.get("pretraining_tp")
    if isinstance(tp, int) and not isinstance(tp, bool) and tp > 1:
        notes.append(f"pretraining_tp={tp}: HF's sliced emulation of the same layers; not modelled")
    return notes


def _hf_refuse(data: dict, where: str, key: str, why: str) -> ConfigError:
    """The error for a ``config.json`` key whose value the model here cannot express."""
    return ConfigError(f"{where}: {key}={data[key]!r}: {why}")


def _hf_check_architecture(data: dict, where: str) -> None:
    """Refuse a ``config.json`` that is not a dense Llama-style decoder: another model type or
    architecture, experts, sliding-window attention, another activation."""
    mtype = data.get("model_type")
    archs = data.get("architectures") or []
    if mtype is not None and mtype not in HF_MODEL_TYPES:
        raise _hf_refuse(
            data,
            where,
            "model_type",
            f"not a Llama-style model (supported: {', '.join(HF_MODEL_TYPES)})",
        )
    if not isinstance(archs, list) or any(
        not isinstance(a, str) or a not in HF_ARCHS for a in archs
    ):  # exact names: a prefix lets LlamaMoEForCausalLM or a classification head through
        raise _hf_refuse(
            data,
            where,
            "architectures",
            f"not a Llama-style decoder (one of {', '.join(HF_ARCHS)})",
        )
    for key in HF_CAPACITY_KEYS:
        if data.get(key) is not None:
            raise _hf_refuse(data, where, key, "a capacity drops tokens; the MoE here is dropless")
    family = mtype or (HF_ARCHS[archs[0]] if archs else "")
    for key in HF_MOE_KEYS * (family not in MOE_TYPES):
        if data.get(key):
            raise _hf_refuse(
                data,
                where,
                key,
                "mixture of experts: the model here is dense (one SwiGLU MLP per layer)",
            )
    if data.get("sliding_window") is not None and data.get("use_sliding_window", True):
        raise _hf_refuse(
            data,
            where,
            "sliding_window",
            "sliding-window attention: the model here attends causally over the whole sequence",
        )
    act = data.get("hidden_act", data.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        key = "hidden_act" if "hidden_act" in data else "hidden_activation"
        raise _hf_refuse(data, where, key, "the MLP here is SwiGLU (silu)")


def _hf_biases(data: dict, where: str, family: str) -> dict[str, bool]:
    """The projections' biases: Qwen2's on Q, K and V always; ``attention_bias`` (Llama, Qwen3:
    Q, K, V and O) and ``mlp_bias`` (Llama: gate, up and down) where the family's class reads
    them; set in a family whose class ignores it, refused naming the key."""
    qkv = family in QKV_BIAS_TYPES
    if family == "qwen2_moe":  # Qwen2-MoE's own key, true by default
        qkv = data.get("qkv_bias", True)
        if not isinstance(qkv, bool):
            raise _hf_refuse(data, where, "qkv_bias", "must be true or false")
    out = {"qkv_bias": qkv, "o_bias": False, "mlp_bias": False}
    attention_bias = ("llama", "qwen3", "qwen3_moe")
    for key, families in (("attention_bias", attention_bias), ("mlp_bias", ("llama",))):
        v = data.get(key)
        if v is None or v is False:
            continue
        if not isinstance(v, bool):
            raise _hf_refuse(data, where, key, "must be true or false")
        if family not in families:
            raise _hf_refuse(data, where, key, f"{family}'s class has no such biases")
        if key == "attention_bias":
            out.update(qkv_bias=True, o_bias=True)
        else:
            out["mlp_bias"] = True
    return out


def _hf_experts(data: dict, where: str, family: str) -> dict[str, int | float | bool]:
    """The experts of a Mixtral or Qwen2/3-MoE ``config.json``: E, k, each expert's width
    (Mixtral's ``intermediate_size``, Qwen's ``moe_intermediate_size``), Qwen2-MoE's shared
    expert, the top-k renormalisation (Mixtral always; Qwen where ``norm_topk_prob``) and the
    load-balancing loss where HF adds it (``output_router_logits``). Every layer here is MoE:
    a sparse step other than 1 or dense ``mlp_only_layers`` is refused, naming the key."""
    E = "num_local_experts" if family == "mixtral" else "num_experts"
    out: dict[str, int | float | bool] = {
        "experts": _hf_value(data, where, "experts", E, None),
        "top_k": _hf_value(data, where, "top_k", "num_experts_per_tok", None),
    }
    if family != "mixtral":
        out["expert_ffn"] = _hf_value(data, where, "expert_ffn", "moe_intermediate_size", None)
        norm = data.get("norm_topk_prob", False)
        if not isinstance(norm, bool):
            raise _hf_refuse(data, where, "norm_topk_prob", "must be true or false")
        out["norm_topk"] = norm
    if family == "qwen2_moe":
        out["shared_ffn"] = _hf_value(
            data, where, "shared_ffn", "shared_expert_intermediate_size", None
        )
    step = data.get("decoder_sparse_step")
    if step not in (None, 1):
        raise _hf_refuse(data, where, "decoder_sparse_step", "every layer here is MoE (1)")
    if data.get("mlp_only_layers"):
        raise _hf_refuse(data, where, "mlp_only_layers", "every layer here is MoE (none dense)")
    on = data.get("output_router_logits", False)
    if not isinstance(on, bool):
        raise _hf_refuse(data, where, "output_router_logits", "must be true or false")
    if on:
        out["aux_loss"] = _hf_value(data, where, "aux_loss", "router_aux_loss_coef", 0.001)
    return out


def _hf_values(data: dict, where: str) -> dict[str, int | float | str | bool]:
    """The :data:`HF_FIELDS` of a ``config.json``, each checked against its range."""
    values: dict[str, int | float | str | bool] = {}
    for field, (key, default) in HF_FIELDS.items():
        values[field] = _hf_value(data, where, field, key, default)
    return values


def _hf_value(
    data: dict, where: str, field: str, key: str, default: str | float | None
) -> int | float:
    """One field's value from ``config.json`` key ``key`` (its default where missing or null,
    a required key where ``default`` is None): an integer or a float, within its range."""
    if key in data and (data[key] is not None or default is None):
        v = data[key]  # null reads as missing where the key has a default, as HF reads it
    elif default is None:
        raise ConfigError(f"{where}: {key}: missing (a Llama-style config.json has it)")
    else:
        v = data[default] if isinstance(default, str) and default in data else default
    lo, hi = RANGES[field]
    integral = field not in FLOATS
    bad = isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
    if bad or (integral and not isinstance(v, int)):
        raise ConfigError(
            f"{where}: {key}={v!r}: must be {'an integer' if integral else 'a number'}"
        )
    if not lo <= v <= hi:
        raise ConfigError(f"{where}: {key}={v!r}: must be between {_num(lo)} and {_num(hi)}")
    return v if integral else float(v)


def _hf_rope(data: dict, where: str, values: dict[str, int | float | str | bool]) -> str:
    """The canonical RoPE scaling of ``rope_scaling`` (transformers 4) or ``rope_parameters``
    (transformers 5, which also moves ``rope_theta`` into it: read from there when the top
    level lacks it); ConfigError naming the key for a scaling not modelled."""
    for key in ("rope_parameters", "rope_scaling"):
        d = data.get(key)
        if d is None:
            continue
        if not isinstance(d, dict):
            raise _hf_refuse(data, where, key, "must be an object")
        if "rope_theta" in d and data.get("rope_theta") is None:
            values["rope_theta"] = _hf_value(d, f"{where}: {key}", "rope_theta", "rope_theta", None)
        try:
            return rope.from_hf(d)
        except rope.RopeError as e:
            raise ConfigError(f"{where}: {key}: {e}") from None
    return ""


def _hf_head_dim(data: dict, where: str, values: dict[str, int | float | str | bool]) -> None:
    """``head_dim`` where the file sets one other than hidden_size/num_attention_heads (Qwen3
    0.6B, 4B, 32B); equal to it, or null, it reads as the default (0)."""
    heads, hidden = cast(int, values["heads"]), cast(int, values["hidden"])
    if data.get("head_dim") is None:
        return
    d = _hf_value(data, where, "head_dim", "head_dim", None)
    if d < 1:
        raise _hf_refuse(data, where, "head_dim", "must be at least 1")
    values["head_dim"] = 0 if hidden % heads == 0 and d == hidden // heads else d


def _hf_model(
    values: dict[str, int | float | str | bool], where: str, family: str = ""
) -> ModelConfig:
    """The :class:`ModelConfig` of the values read; a rule across fields is said with the
    file's keys (``family``'s: Mixtral counts its experts in ``num_local_experts``)."""
    try:
        return ModelConfig(name="custom", **cast(ModelOverrides, values))  # int where integral
    except ConfigError as e:  # a rule across fields: say it with the file's keys
        msg = str(e)
        keys = [(f, k) for f, (k, _) in HF_FIELDS.items()] + [("head_dim", "head_dim")]
        experts = "num_local_experts" if family == "mixtral" else "num_experts"
        keys += [("top_k", "num_experts_per_tok"), ("experts", experts)]
        for field, key in keys:
            msg = msg.replace(f"model.{field}", key)
        raise ConfigError(f"{where}: {msg}") from None


def require_dense(cfg: ModelConfig, what: str, why: str) -> None:
    """Refuse a model with experts where ``what`` (a command) handles dense ones only, saying
    ``why``."""
    if cfg.moe:
        raise ConfigError(f"model.experts={cfg.experts}: {what} covers dense models only ({why})")


def read_hf_config(path: str) -> tuple[ModelConfig, list[str]]:
    """:func:`hf_config` of a ``config.json`` file (or of a folder holding one)."""
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise ConfigError(
            f"--model={path!r}: no such config.json file, and not a preset ({', '.join(PRESETS)})"
        )
    data = read_json_input(p, "--model")  # a config.json is a few kB
    return hf_config(data, str(p))


def is_model_path(name: str) -> bool:
    """Whether ``--model`` names a ``config.json`` (a path) rather than a preset."""
    return name.endswith(".json") or "/" in name or name.startswith(".")


def load_model(name_or_path: str) -> tuple[ModelConfig, list[str]]:
    """A preset by name, or the model of a Hugging Face ``config.json`` (path or folder),
    named by the path as given: a rank process or a record reads the same file again."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path], []
    if is_model_path(name_or_path):
        cfg, notes = read_hf_config(name_or_path)
        return dataclasses.replace(cfg, name=name_or_path), notes
    raise ConfigError(
        f"--model={name_or_path!r}: unknown preset (known: {', '.join(PRESETS)}) and not a "
        f"config.json path"
    )


def model_with_overrides(name_or_path: str, items: list[str] | None) -> ModelConfig:
    """``--model`` (a preset or a ``config.json``) with ``--set`` overrides on top."""
    cfg, _ = load_model(name_or_path)
    overrides = parse_overrides(items)
    return dataclasses.replace(cfg, **overrides) if overrides else cfg
