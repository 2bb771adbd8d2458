"""The reference's mixture of experts equals Hugging Face's own classes (``MixtralForCausalLM``,
``Qwen2MoeForCausalLM`` with its gated shared expert, ``Qwen3MoeForCausalLM`` with its QK norms)
with copied weights: logits, loss (the load-balancing loss included, as HF adds it) and every
gradient, fp64 to rounding and fp32 tight; and their ``config.json`` reads back as the model.

Dropless routing: every token goes to its k experts, none dropped, so each strategy's MoE can
equal this reference exactly (tspbench/core/moe.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.hf import (
    CLASS_PREFIX,
    MOE_FAMILIES,
    QK_NORM_FAMILIES,
    QKV_BIAS_FAMILIES,
    hf_grad,
    paired,
)
from tests.helpers.hf import in_fp64 as hf_in_fp64
from tspbench.core import moe
from tspbench.core.config import ConfigError, ModelConfig, hf_config, parse_overrides
from tspbench.core.reference import ReferenceModel, init_param, make_batch, param_shapes


def _cfg(family: str, **changes) -> ModelConfig:
    """A small model of ``family``: 6 experts, 2 per token (Qwen: narrower experts than the
    dense width, as Qwen's moe_intermediate_size; Qwen2-MoE: a shared expert)."""
    cfg = ModelConfig(
        vocab=96, hidden=48, layers=2, heads=6, kv_heads=2, ffn=40, rope_theta=500.0,
        norm_eps=1e-5, init_std=0.2, qk_norm=family in QK_NORM_FAMILIES,
        qkv_bias=family in QKV_BIAS_FAMILIES, experts=6, top_k=2,
        expert_ffn=0 if family == "mixtral" else 24, shared_ffn=32 * (family == "qwen2_moe"),
        norm_topk=family != "qwen2_moe",
    )  # fmt: skip
    return dataclasses.replace(cfg, **changes)


def _step(ours, theirs, cfg, tokens, labels):
    """(our logits, loss, grads), (theirs), the loss HF's: cross-entropy, plus its coefficient
    times its load-balancing loss where the model has one."""
    loss, hidden = ours.loss(tokens, labels)
    logits = hidden @ ours.head().T
    loss.backward()
    out = theirs(input_ids=tokens, output_router_logits=bool(cfg.aux_loss))
    their_loss = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())
    if cfg.aux_loss:
        their_loss = their_loss + cfg.aux_loss * out.aux_loss
    their_loss.backward()
    grads = {n: p.grad for n, p in ours.named_full_params().items()}
    return (logits, loss, grads), (
        out.logits,
        their_loss,
        {n: hf_grad(theirs, n, cfg) for n in grads},
    )


def _close(a, b, tol: float) -> None:
    (la, lossa, ga), (lb, lossb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=tol, atol=tol)
    torch.testing.assert_close(lossa, lossb, rtol=tol, atol=tol)
    for n in ga:
        assert gb[n] is not None, n
        scale = gb[n].abs().max().item()
        torch.testing.assert_close(ga[n], gb[n], rtol=tol, atol=tol * scale, msg=n)


@pytest.mark.parametrize("aux", [0.0, 0.05])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_reference_equals_hf_fp64(family, aux):
    """fp64 to rounding; with the load-balancing loss, to HF's fp32 sums of its router
    probabilities (``load_balancing_loss_func`` takes ``.float()`` whatever the dtype)."""
    cfg = _cfg(family, aux_loss=aux)
    ours, theirs = paired(cfg, family, torch.float64)
    hf_in_fp64(theirs, cfg)
    tokens, labels = make_batch(cfg, 2, 24, seed=1)
    a, b = _step(ours, theirs, cfg, tokens, labels)
    _close(a, b, tol=1e-8 if aux else 1e-11)
    routed = [n for n in a[2] if n.endswith((".ew1", ".ew3", ".ew2", ".router"))]
    assert routed and all(a[2][n].abs().sum() > 0 for n in routed)  # every kind trained
    if aux:  # the load-balancing loss moved the router's gradient
        plain, _ = paired(dataclasses.replace(cfg, aux_loss=0.0), family, torch.float64)
        plain.loss(tokens, labels)[0].backward()
        r = "layers.0.router"
        assert not torch.allclose(plain.p(r).grad, ours.p(r).grad, rtol=1e-6, atol=0)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_reference_equals_hf_fp32(family):
    """HF's own fp32 routers and RoPE, the load-balancing loss on: fp32 tight."""
    cfg = _cfg(family, aux_loss=0.02)
    ours, theirs = paired(cfg, family, torch.float32)
    tokens, labels = make_batch(cfg, 2, 24, seed=2)
    _close(*_step(ours, theirs, cfg, tokens, labels), tol=2e-5)


def test_qwen_top_k_weights_without_renormalisation():
    """Qwen3-MoE with ``norm_topk_prob`` false (its class's default) equals HF too, and differs
    from the renormalised model: the flag is read, not ignored."""
    cfg = _cfg("qwen3_moe", norm_topk=False)
    ours, theirs = paired(cfg, "qwen3_moe", torch.float64)
    hf_in_fp64(theirs, cfg)
    tokens, labels = make_batch(cfg, 2, 24, seed=3)
    a, b = _step(ours, theirs, cfg, tokens, labels)
    _close(a, b, tol=1e-11)
    renormed = ReferenceModel(dataclasses.replace(cfg, norm_topk=True), dtype=torch.float64)
    assert not torch.allclose(renormed.loss(tokens, labels)[0], a[1])


def test_every_token_reaches_its_k_experts():
    """Dropless: the MoE output is exactly the sum over each token's k experts, each computed
    alone, whatever the load (a router favouring one expert included)."""
    torch.manual_seed(0)
    cfg = _cfg("mixtral", experts=4, top_k=3)
    model = ReferenceModel(cfg, dtype=torch.float64)
    p = {k: model.p(f"layers.0.{k}") for k in moe.moe_params(cfg)}
    with torch.no_grad():
        p["router"][0] += 5.0  # most tokens prefer expert 0
    m = torch.randn(2, 10, cfg.hidden, dtype=torch.float64) + 0.5  # (its sum sets the bias)
    out = moe.moe_mlp(m, p, cfg.top_k, cfg.norm_topk)
    probs = torch.softmax(m @ p["router"].T, -1)
    w, idx = probs.topk(cfg.top_k, -1)
    w = w / w.sum(-1, keepdim=True)
    want = torch.zeros_like(m)
    for b in range(2):
        for t in range(10):
            for j in range(cfg.top_k):
                e = idx[b, t, j]
                y = moe.expert_ffn(m[b, t], p["ew1"][e], p["ew3"][e], p["ew2"][e])
                want[b, t] += w[b, t, j] * y
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert (idx == 0).any(-1).float().mean() > 0.9


def test_an_experts_weights_are_its_own_rows():
    """Each expert's weights are a function of the seed, the name and the expert: a rank that
    owns experts 2..3 generates exactly their slice of the whole stack."""
    cfg = _cfg("qwen3_moe")
    for k in ("ew1", "ew3", "ew2"):
        full = init_param(cfg, f"layers.1.{k}", seed=3)
        assert full.shape == param_shapes(cfg)[f"layers.1.{k}"]
        torch.testing.assert_close(init_param(cfg, f"layers.1.{k}", 3, rows=slice(2, 4)), full[2:4])
    assert cfg.n_params() == sum(torch.Size(s).numel() for s in param_shapes(cfg).values())
    q2 = _cfg("qwen2_moe")
    assert q2.n_params() == sum(torch.Size(s).numel() for s in param_shapes(q2).values())


def _file(family: str, **extra) -> dict:
    data = {
        "architectures": [f"{CLASS_PREFIX.get(family, 'Mixtral')}ForCausalLM"],
        "model_type": family, "vocab_size": 96, "hidden_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 2, "intermediate_size": 40,
        "num_experts_per_tok": 2,
    }  # fmt: skip
    if family == "mixtral":
        data.update(num_local_experts=6, sliding_window=None)
    else:
        data.update(num_experts=6, moe_intermediate_size=24, use_sliding_window=False)
        data.update(norm_topk_prob=family == "qwen3_moe", decoder_sparse_step=1, mlp_only_layers=[])
    if family == "qwen2_moe":
        data["shared_expert_intermediate_size"] = 32
    data.update(extra)
    return data


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_config_json_reads_as_the_model(family):
    read, notes = hf_config(_file(family, router_aux_loss_coef=0.02))
    want = _cfg(family)
    assert dataclasses.replace(read, name=want.name, rope_theta=want.rope_theta,
                               norm_eps=want.norm_eps, init_std=want.init_std) == want  # fmt: skip
    assert any("router_aux_loss_coef=0.02" in n and "off here" in n for n in notes)
    on, _ = hf_config(_file(family, router_aux_loss_coef=0.02, output_router_logits=True))
    assert on.aux_loss == 0.02


@pytest.mark.parametrize(
    "data, message",
    [
        (_file("mixtral", num_experts_per_tok=7), "num_experts_per_tok=7: must be between 1 and"),
        (
            _file("qwen3_moe", decoder_sparse_step=2),
            "decoder_sparse_step=2: every layer here is MoE",
        ),
        (_file("qwen2_moe", mlp_only_layers=[0]), "mlp_only_layers=[0]: every layer here is MoE"),
        (_file("mixtral", capacity_factor=1.25), "capacity_factor=1.25: a capacity drops tokens"),
        ({**_file("qwen3_moe"), "model_type": "qwen3"}, "num_experts=6: mixture of experts"),
        (_file("qwen3_moe", norm_topk_prob="yes"), "norm_topk_prob='yes': must be true or false"),
    ],
)
def test_moe_config_json_bad_input(data, message):
    if data["model_type"] == "qwen3":
        data["architectures"] = ["Qwen3ForCausalLM"]
    with pytest.raises(ConfigError, match=None) as e:
        hf_config(data)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "items, message",
    [
        (["experts=4", "top_k=5"], "model.top_k=5: must be between 1 and model.experts=4"),
        (["experts=4"], "model.top_k=0: must be between 1 and model.experts=4"),
        (["top_k=2"], "model.top_k=2: only with experts"),
        (["experts=4", "top_k=2", "mlp_bias=true"], "model.mlp_bias=True: an MoE layer"),
        (["capacity_factor=1.25"], "capacity_factor=1.25: the MoE here is dropless"),
    ],
)
def test_moe_overrides_bad_input(items, message):
    with pytest.raises(ConfigError) as e:
        dataclasses.replace(ModelConfig(), **parse_overrides(items))
    assert message in str(e.value)


def test_an_expert_no_token_reaches_gets_a_zero_gradient():
    """A rank's experts that no token reached get a zero gradient, not none (TP's rank of one
    expert, say: the shared routed-experts loop it calls): AdamW would move one and not the
    other, and the strategies would part. (TSP's own schedules run every expert block on
    every rank whatever its rows: tests/integration/test_moe.py.)"""
    torch.manual_seed(0)
    cfg = _cfg("mixtral", experts=4, top_k=1)
    model = ReferenceModel(cfg, dtype=torch.float64)
    m = torch.randn(6, cfg.hidden, dtype=torch.float64)
    router = model.p("layers.0.router").detach().clone()
    router[3] -= 100 * m.sum(0) / m.sum(0).norm()  # nothing goes to expert 3
    _, weights, idx = moe.route(m, router, cfg.top_k, cfg.norm_topk)
    assert not (idx == 3).any()
    own = {k: model.p(f"layers.0.{k}")[3:].detach().clone().requires_grad_() for k in moe.EXPERTS}
    moe.routed_experts(m, weights, idx, own, 3, cfg.experts).sum().backward()
    assert all(own[k].grad is not None and torch.all(own[k].grad == 0) for k in own)


@pytest.mark.parametrize(
    "data, message",
    [
        (_file("mixtral", num_experts_per_tok=7), "between 1 and num_local_experts=6"),
        (_file("mixtral", output_router_logits="yes"), "output_router_logits='yes': must be"),
    ],
)
def test_moe_config_json_names_the_familys_keys(data, message):
    with pytest.raises(ConfigError) as e:
        hf_config(data)
    assert message in str(e.value)


def test_moe_fields_are_numbers_and_belong_to_experts():
    with pytest.raises(ConfigError, match="aux_loss=True: must be a number"):
        ModelConfig(experts=4, top_k=2, aux_loss=True)
    with pytest.raises(ConfigError, match="norm_topk=False: only with experts"):
        ModelConfig(norm_topk=False)


@pytest.mark.parametrize("t, k, E", [(12, 2, 6), (7, 3, 4), (5, 4, 4)])
def test_balanced_routing_spreads_the_slots_evenly_and_finds_them_as_where_does(t, k, E):
    """Even routing (the estimator's): each token's k experts distinct, every expert t k / E
    rows within one, the counts and each expert's (token, slot) rows those that ``torch.where``
    finds in its routing, the weights the router's probabilities of the chosen experts."""
    m, router = torch.randn(t, 8), torch.randn(E, 8)
    with moe.balanced():
        probs, weights, idx = moe.route(m, router, k, norm_topk=False)
        counts = moe.expert_counts(idx, E)
        rows = [moe.rows_of(idx, e, E) for e in range(E)]
    assert not moe.is_balanced()
    assert all(len(set(r)) == k for r in idx.tolist())
    assert counts.tolist() == torch.bincount(idx.flatten(), minlength=E).tolist()
    assert counts.tolist() == moe.even_counts(t, k, E) and max(counts) - min(counts) <= 1
    for e, (tok, slot) in enumerate(rows):
        want = torch.where(idx == e)
        assert torch.equal(tok, want[0]) and torch.equal(slot, want[1])
    assert torch.equal(weights, probs.gather(-1, idx))
