"""The single-device reference equals Hugging Face's own class for each family it reads
(``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` with its QKV biases,
``Qwen3ForCausalLM`` with its QK norms) with copied weights: logits, loss and every
gradient, fp64 to rounding and fp32 tight, with each RoPE scaling published configs ship, tied
embeddings and a ``head_dim`` wider than hidden/heads; the RoPE tables equal HF's; greedy
generation equals HF's ``generate``.

The oracle every strategy is checked against is only as good as this check: a strategy equal to
a reference that is not the model people train proves nothing about that model.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.hf import (
    FAMILIES,
    QK_NORM_FAMILIES,
    QKV_BIAS_FAMILIES,
    hf_name,
    in_fp64,
    paired,
)
from tspbench.core.config import ModelConfig, hf_config
from tspbench.core.layers import rope_tables
from tspbench.core.reference import make_batch

SCALINGS = {
    "default": "",
    "linear": "linear,factor=4.0",
    # short original contexts, so the scalings change the tiny model's 24 positions
    "llama3": "llama3,factor=8.0,low_freq_factor=1.0,high_freq_factor=4.0,"
    "original_max_position_embeddings=16.0",
    "yarn": "yarn,factor=4.0,original_max_position_embeddings=16.0",
    "yarn-untruncated": "yarn,factor=3.0,original_max_position_embeddings=12.0,beta_fast=16.0,"
    "attention_factor=1.2,truncate=0.0",
}


def _cfg(scaling: str, family: str = "llama") -> ModelConfig:
    return ModelConfig(
        vocab=96, hidden=48, layers=2, heads=6, kv_heads=2, ffn=80, rope_theta=500.0,
        norm_eps=1e-5, init_std=0.2, rope_scaling=scaling, qk_norm=family in QK_NORM_FAMILIES,
        qkv_bias=family in QKV_BIAS_FAMILIES,
    )  # fmt: skip


def _step(ours, theirs, tokens, labels):
    """(our logits, loss, grads by our name), (theirs, by our name)."""
    hidden = ours.forward(tokens)
    logits = hidden @ ours.head().T
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    their_logits = theirs(input_ids=tokens).logits
    their_loss = F.cross_entropy(their_logits.flatten(0, 1), labels.flatten())
    their_loss.backward()
    named = dict(theirs.named_parameters())
    grads = {n: p.grad for n, p in ours.named_full_params().items()}
    their_grads = {n: named[hf_name(n)].grad for n in grads}
    return (logits, loss, grads), (their_logits, their_loss, their_grads)


def _close(a, b, tol: float) -> None:
    (la, lossa, ga), (lb, lossb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=tol, atol=tol)
    torch.testing.assert_close(lossa, lossb, rtol=tol, atol=tol)
    for n in ga:
        scale = gb[n].abs().max().item()
        torch.testing.assert_close(ga[n], gb[n], rtol=tol, atol=tol * scale, msg=n)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("family", FAMILIES)
def test_reference_equals_hf_fp64(family, scaling):
    cfg = _cfg(SCALINGS[scaling], family)
    ours, theirs = paired(cfg, family, torch.float64)
    in_fp64(theirs, cfg)
    tokens, labels = make_batch(cfg, 2, 24, seed=1)
    _close(*_step(ours, theirs, tokens, labels), tol=1e-11)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("family", FAMILIES)
def test_reference_equals_hf_fp32_with_hf_rope(family, scaling):
    """HF's own RoPE (fp32 tables) end to end: fp32 tight."""
    cfg = _cfg(SCALINGS[scaling], family)
    ours, theirs = paired(cfg, family, torch.float32)
    tokens, labels = make_batch(cfg, 2, 24, seed=2)
    _close(*_step(ours, theirs, tokens, labels), tol=2e-5)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_rope_tables_equal_hf(scaling):
    """Our fp64 tables equal HF's fp32 ones to fp32 rounding, far past the original context,
    and a scaling changes them (else the model tests above would not see it)."""
    cfg = _cfg(SCALINGS[scaling])
    _, theirs = paired(cfg, "llama", torch.float32)
    pos = torch.arange(0, 4096, 7)
    x = torch.zeros(1, dtype=torch.float32)
    cos_hf, sin_hf = theirs.model.rotary_emb(x, pos[None])
    cos, sin = rope_tables(pos, cfg, torch.float64)
    # HF's fp32 angle pos * inv_freq is off by up to pos * 2^-24 radians
    tol = 4096 * 2.0**-24 * 4
    torch.testing.assert_close(cos_hf[0].double(), cos, rtol=0, atol=tol)
    torch.testing.assert_close(sin_hf[0].double(), sin, rtol=0, atol=tol)
    if scaling != "default":
        plain, _ = rope_tables(pos, _cfg(""), torch.float64)
        assert (plain - cos).abs().max() > 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_hf_generate(family):
    """HF's generate (its KV-cache path) and greedy argmax over the reference's full forward
    give the same tokens, with Llama 3's scaling."""
    cfg = _cfg(SCALINGS["llama3"], family)
    ours, theirs = paired(cfg, family, torch.float64)
    in_fp64(theirs, cfg)
    prompt, _ = make_batch(cfg, 2, 12, seed=3)
    new = 10
    out = theirs.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),  # else generate masks the tokens equal to pad
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
    )
    tokens = prompt
    with torch.no_grad():
        for _ in range(new):
            nxt = (ours.forward(tokens)[:, -1] @ ours.head().T).argmax(-1)
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
    assert torch.equal(out, tokens)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tied_embeddings_equal_hf(family):
    """``tie_word_embeddings`` (Llama 3.2 1B/3B, the small Qwens): one [V, h] matrix is the
    embedding and the LM head; its gradient is the sum of both uses, as HF's tied parameter's."""
    cfg = dataclasses.replace(_cfg(SCALINGS["llama3"], family), tie_embeddings=True)
    ours, theirs = paired(cfg, family, torch.float64)
    in_fp64(theirs, cfg)
    assert "head" not in dict(ours.named_full_params())
    tokens, labels = make_batch(cfg, 2, 24, seed=4)
    _close(*_step(ours, theirs, tokens, labels), tol=1e-11)


@pytest.mark.parametrize("family", FAMILIES)
def test_wide_heads_equal_hf(family):
    """``head_dim`` wider than hidden/heads (Qwen3 0.6B: 128 for h = 1024 over 16 heads): Q
    and W_o's input are heads x head_dim wide, RoPE and the QK norms act over head_dim."""
    cfg = dataclasses.replace(_cfg(SCALINGS["yarn"], family), head_dim=12)
    assert cfg.q_dim == 72 != cfg.hidden
    ours, theirs = paired(cfg, family, torch.float64)
    in_fp64(theirs, cfg)
    assert theirs.model.layers[0].self_attn.q_proj.weight.shape == (72, 48)
    tokens, labels = make_batch(cfg, 2, 24, seed=5)
    _close(*_step(ours, theirs, tokens, labels), tol=1e-11)


@pytest.mark.parametrize(
    "family, biases",
    [("llama", {"qkv_bias": True, "o_bias": True, "mlp_bias": True}),
     ("llama", {"mlp_bias": True}),
     ("qwen3", {"qkv_bias": True, "o_bias": True})],
)  # fmt: skip
def test_attention_and_mlp_biases_equal_hf(family, biases):
    """Llama's ``attention_bias`` (Q, K, V and O) and ``mlp_bias`` (gate, up, down), Qwen3's
    ``attention_bias``: every bias and its gradient as HF's, and the config.json keys read so."""
    cfg = dataclasses.replace(_cfg(SCALINGS["llama3"], family), **biases)
    ours, theirs = paired(cfg, family, torch.float64)
    in_fp64(theirs, cfg)
    names = dict(ours.named_full_params())
    assert ("layers.1.bo" in names) == cfg.o_bias and ("layers.1.b2" in names) == cfg.mlp_bias
    tokens, labels = make_batch(cfg, 2, 24, seed=6)
    _close(*_step(ours, theirs, tokens, labels), tol=1e-11)
    data = {
        "architectures": [f"{family.capitalize()}ForCausalLM"],
        "model_type": family,
        "vocab_size": 96,
        "hidden_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "intermediate_size": 80,
        "attention_bias": cfg.o_bias,
    }
    if family == "llama":
        data["mlp_bias"] = cfg.mlp_bias
    read, _ = hf_config(data)
    assert (read.qkv_bias, read.o_bias, read.mlp_bias) == (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias)
