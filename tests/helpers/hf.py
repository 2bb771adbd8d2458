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
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")
QKV_BIAS_FAMILIES = ("qwen2", "qwen2_moe")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
CLASS_PREFIX = {"qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe"}
# an MoE layer's parameters -> HF's (the experts' gate and up stacked in one gate_up_proj)
MOE_NAMES = {
    "router": "mlp.gate.weight",
    "ew2": "mlp.experts.down_proj",
    "sw1": "mlp.shared_expert.gate_proj.weight",
    "sw3": "mlp.shared_expert.up_proj.weight",
    "sw2": "mlp.shared_expert.down_proj.weight",
    "sgate": "mlp.shared_expert_gate.weight",
}


def hf_name(name: str) -> str:
    """The HF parameter name of one of ours (``layers.3.wq`` -> ``model.layers.3.self_attn...``)."""
    if name == "embed":
        return "model.embed_tokens.weight"
    if name == "norm":
        return "model.norm.weight"
    if name == "head":
        return "lm_head.weight"
    _, i, key = name.split(".")
    if key in ("ew1", "ew3"):
        return f"model.layers.{i}.mlp.experts.gate_up_proj"
    if key in MOE_NAMES:
        return f"model.layers.{i}.{MOE_NAMES[key]}"
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
    if family in ("qwen3", "qwen3_moe"):
        assert cfg.qk_norm, "a Qwen3 model has QK norms"
        kwargs.update(use_sliding_window=False, sliding_window=None)
    if family in MOE_FAMILIES:
        kwargs.update(_moe_kwargs(cfg, family))
    prefix = CLASS_PREFIX.get(family, family.capitalize())
    config_cls = getattr(transformers, f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix}ForCausalLM")
    return model_cls(config_cls(**kwargs)).to(dtype)


def _moe_kwargs(cfg: ModelConfig, family: str) -> dict:
    """The config keys of an MoE family's experts (every layer MoE, the aux loss on where ours
    has it)."""
    assert cfg.moe, "an MoE family needs experts"
    kw: dict = {"num_experts_per_tok": cfg.top_k, "output_router_logits": bool(cfg.aux_loss)}
    kw["experts_implementation"] = "eager"  # the class's own loop: grouped_mm takes no fp64
    kw["router_aux_loss_coef"] = cfg.aux_loss
    if family == "mixtral":
        assert cfg.norm_topk and not cfg.shared_ffn, "Mixtral renormalises, has no shared expert"
        kw.update(num_local_experts=cfg.experts, intermediate_size=cfg.moe_ffn)
        return kw
    kw.update(
        num_experts=cfg.experts, moe_intermediate_size=cfg.moe_ffn, norm_topk_prob=cfg.norm_topk,
        decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip
    if family == "qwen2_moe":
        assert cfg.shared_ffn, "a Qwen2-MoE layer has a shared expert"
        kw.update(shared_expert_intermediate_size=cfg.shared_ffn, qkv_bias=cfg.qkv_bias)
    else:
        assert not cfg.shared_ffn, "Qwen3-MoE has no shared expert"
    return kw


def hf_state(ours: ReferenceModel) -> dict[str, torch.Tensor]:
    """Our weights under HF's names (an expert's gate and up stacked in its gate_up_proj)."""
    full = {n: p.detach().clone() for n, p in ours.named_full_params().items()}
    state = {hf_name(n): p for n, p in full.items() if not n.endswith((".ew1", ".ew3"))}
    for n in full:
        if n.endswith(".ew1"):
            state[hf_name(n)] = torch.cat([full[n], full[n[:-1] + "3"]], dim=1)
    return state


def hf_grad(theirs, name: str, cfg: ModelConfig) -> torch.Tensor:
    """The gradient of HF's parameter that is our ``name`` (ew1, ew3: its half of gate_up)."""
    g = dict(theirs.named_parameters())[hf_name(name)].grad
    if name.endswith(".ew1"):
        return g[:, : cfg.moe_ffn]
    if name.endswith(".ew3"):
        return g[:, cfg.moe_ffn :]
    return g


def paired(cfg: ModelConfig, family: str, dtype: torch.dtype, seed: int = 0):
    """(our reference, the HF model with our weights), both in ``dtype``."""
    ours = ReferenceModel(cfg, seed=seed, dtype=dtype)
    theirs = hf_model(cfg, family, dtype)
    state = hf_state(ours)
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
    routers_in_input_dtype(model)


def routers_in_input_dtype(model) -> None:
    """Make an HF MoE model's routers take their softmax in the input's dtype: HF's is fp32
    whatever the dtype (ours is fp64 for fp64), so an fp64 comparison would see fp32 weights.
    The same steps otherwise: softmax, top-k, renormalised where the class does."""
    for m in model.modules():
        if not type(m).__name__.endswith("TopKRouter"):
            continue

        def forward(h: torch.Tensor, m=m):
            logits = torch.nn.functional.linear(h.reshape(-1, m.hidden_dim), m.weight)
            top, idx = torch.topk(torch.softmax(logits, dim=-1), m.top_k, dim=-1)
            if getattr(m, "norm_topk_prob", True):  # Mixtral's has no flag: always
                top = top / top.sum(-1, keepdim=True)
            return logits, top, idx

        m.forward = forward


def norms_in_input_dtype(model) -> None:
    """Make the HF model's RMSNorms compute in their input's dtype: HF's upcast to fp32 whatever
    the dtype (ours computes fp64 inputs in fp64), so an fp64 comparison would see fp32 norms."""
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):

            def forward(h: torch.Tensor, m=m) -> torch.Tensor:
                var = h.pow(2).mean(-1, keepdim=True)
                return m.weight * (h * torch.rsqrt(var + m.variance_epsilon))

            m.forward = forward
