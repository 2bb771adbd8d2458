"""The reference model beside Hugging Face's own class for its family, with copied weights.

transformers is a dev dependency: the suite's own code never imports it; these helpers build the
HF model that :class:`~tspbench.core.reference.ReferenceModel` must equal.
"""

from __future__ import annotations

import torch

from tspbench.core import rope
from tspbench.core.config import HF_FIELDS, ModelConfig
from tspbench.core.layers import rope_tables
from tspbench.core.reference import ReferenceModel

# our layer parameter -> the HF module path inside model.layers.<i>
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "wq": "self_attn.q_proj",
    "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj",
    "wo": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "w1": "mlp.gate_proj",
    "w3": "mlp.up_proj",
    "w2": "mlp.down_proj",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
}
BIASES = {"bq": "wq", "bk": "wk", "bv": "wv", "bo": "wo", "b1": "w1", "b3": "w3", "b2": "w2"}
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
QK_NORM_FAMILIES = ("qwen3",)
QKV_BIAS_FAMILIES = ("qwen2",)


def hf_name(name: str) -> str:
    """The HF parameter name of one of ours (``layers.3.wq`` -> ``model.layers.3.self_attn...``)."""
    if name == "embed":
        return "model.embed_tokens.weight"
    if name == "norm":
        return "model.norm.weight"
    if name == "head":
        return "lm_head.weight"
    _, i, key = name.split(".")
    if key in BIASES:
        return f"model.layers.{i}.{LAYER_NAMES[BIASES[key]]}.bias"
    return f"model.layers.{i}.{LAYER_NAMES[key]}.weight"


def hf_rope(cfg: ModelConfig) -> dict:
    """``rope_parameters`` as transformers 5 reads them."""
    kind, values = rope.parse(cfg.rope_scaling)
    out: dict = {"rope_type": kind or "default", "rope_theta": cfg.rope_theta}
    for key, v in values.items():
        if key == "original_max_position_embeddings":
            out[key] = int(v)
        elif key == "truncate":
            out[key] = bool(v)
        elif not (key == "attention_factor" and v == 0):
            out[key] = v
    return out


def hf_model(cfg: ModelConfig, family: str, dtype: torch.dtype):
    """An HF ``<Family>ForCausalLM`` of ``cfg``'s shapes (random weights: copy ours in)."""
    import transformers

    # the config.json keys the suite reads (HF_FIELDS), written back; theta rides in the RoPE
    kwargs = {key: getattr(cfg, f) for f, (key, _) in HF_FIELDS.items() if f != "rope_theta"}
    kwargs.update(
        rope_parameters=hf_rope(cfg),
        max_position_embeddings=4096,
        tie_word_embeddings=cfg.tie_embeddings,
        # SDPA: eager attention takes its softmax in fp32 whatever the dtype
        attn_implementation="sdpa",
    )
    kwargs["head_dim"] = cfg.d_head  # every family reads it (Qwen3 0.6B's is 2h/heads)
    if family in ("llama", "qwen3"):  # attention_bias: Q, K, V and O together
        assert cfg.o_bias == (cfg.qkv_bias and family != "qwen2"), "attention_bias is all four"
        kwargs.update(attention_bias=cfg.o_bias)
    if family == "llama":
        kwargs.update(mlp_bias=cfg.mlp_bias)
    else:
        assert not cfg.mlp_bias, f"{family} has no mlp_bias"
    if family == "mistral":
        assert not cfg.qkv_bias and not cfg.o_bias, "Mistral has no biases"
        kwargs.update(sliding_window=None)
    if family == "qwen2":
        assert cfg.qkv_bias, "a Qwen2 model has QKV biases"
        kwargs.update(use_sliding_window=False, sliding_window=None)
    if family == "qwen3":
        assert cfg.qk_norm, "a Qwen3 model has QK norms"
        kwargs.update(use_sliding_window=False, sliding_window=None)
    config_cls = getattr(transformers, f"{family.capitalize()}Config")
    model_cls = getattr(transformers, f"{family.capitalize()}ForCausalLM")
    return model_cls(config_cls(**kwargs)).to(dtype)


def paired(cfg: ModelConfig, family: str, dtype: torch.dtype, seed: int = 0):
    """(our reference, the HF model with our weights), both in ``dtype``."""
    ours = ReferenceModel(cfg, seed=seed, dtype=dtype)
    theirs = hf_model(cfg, family, dtype)
    state = {hf_name(n): p.detach().clone() for n, p in ours.named_full_params().items()}
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if cfg.tie_embeddings else set()  # (HF's tie: the embedding)
    assert not unexpected and all("rotary" in k or k in tied for k in missing), missing
    if cfg.tie_embeddings:
        assert theirs.lm_head.weight is theirs.model.embed_tokens.weight
    return ours, theirs


def in_fp64(model, cfg: ModelConfig) -> None:
    """Make the fp64 HF model compute in fp64 throughout: cos/sin from :func:`rope_tables` (HF
    builds them in fp32 whatever the dtype; the tables are compared with HF's separately) and
    its norms in the input dtype."""

    def forward(x: torch.Tensor, position_ids: torch.Tensor):
        cos, sin = rope_tables(position_ids[0], cfg, x.dtype)
        return cos[None], sin[None]

    model.model.rotary_emb.forward = forward
    norms_in_input_dtype(model)


def norms_in_input_dtype(model) -> None:
    """Make the HF model's RMSNorms compute in their input's dtype: HF's upcast to fp32 whatever
    the dtype (ours computes fp64 inputs in fp64), so an fp64 comparison would see fp32 norms."""
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):

            def forward(h: torch.Tensor, m=m) -> torch.Tensor:
                var = h.pow(2).mean(-1, keepdim=True)
                return m.weight * (h * torch.rsqrt(var + m.variance_epsilon))

            m.forward = forward
