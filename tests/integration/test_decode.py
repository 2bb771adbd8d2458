"""Decode (docs/decode.md): every strategy's greedy generation equals the single-device model
run without a cache (tokens exactly, logits fp32 rtol 1e-4) at D 2 and 4, MHA and GQA, GQA with
kv_heads < T where TP and TP+SP replicate KV heads; in bf16, each strategy's logits are within
2e-2 of the fp32 model fed the same tokens, and each greedy token is its argmax or a near-tie;
the bytes each decode step counts equal the closed form exactly; the cache's bytes equal the
closed form and its slices stay balanced; and TSP moves no weight per token: its bytes per step
do not change with ffn and vocab, and no broadcast or send/recv runs in a step.

One 4-rank gloo world runs every case (side-by-side model groups when D < 4).
"""

from __future__ import annotations

import pytest

from tests.helpers.configs import LLAMA3_ROPE_TINY
from tests.helpers.distributed import run_world

MODELS = {
    "mha": {"qkv_bias": True, "o_bias": True, "mlp_bias": True},  # Llama's attention/MLP biases
    # with Llama 3.1's RoPE scaling, Qwen3's QK norms and wide heads (Q 2h wide), Qwen2's QKV
    # biases, tied embeddings
    "gqa": {
        "kv_heads": 4,
        "rope_scaling": LLAMA3_ROPE_TINY,
        "qk_norm": True,
        "qkv_bias": True,
        "tie_embeddings": True,
        "head_dim": 16,
    },  # fmt: skip
    "kv2": {"kv_heads": 2, "qkv_bias": True},  # and Qwen2's QKV biases (replicated below T)
    "kv1": {"kv_heads": 1},
}
LAYOUTS = {
    "single": ([{"D": 1}], ("mha", "gqa", "kv1")),
    "tp": ([{"D": 2}, {"D": 4}], ("mha", "gqa", "kv2", "kv1")),  # kv2, kv1 < 4: replicated
    "sp": ([{"D": 2}, {"D": 4}], ("mha", "gqa", "kv1")),
    "tsp": ([{"D": 2}, {"D": 4}], ("mha", "gqa")),  # TSP's layout needs kv_heads % D == 0
    "tpsp": ([{"D": 2, "tp": 2, "sp": 1}, {"D": 2, "tp": 1, "sp": 2}, {"D": 4, "tp": 2, "sp": 2}],
             ("mha", "gqa", "kv1")),  # kv1 < T = 2: replicated
}  # fmt: skip
WIDE = {"ffn": 384, "vocab": 512}  # TSP: same bytes per token with 3x the MLP, 2x the vocabulary


def _cases() -> list[dict]:
    cases = []
    for strat, (layouts, models) in LAYOUTS.items():
        for lay in layouts:
            name = "x".join(str(lay[k]) for k in ("tp", "sp") if k in lay) or str(lay["D"])
            for model in models:
                base = {"strategy": strat, "model": MODELS[model], **lay}
                cases.append({"id": f"{strat}-D{name}-{model}", "P": 16, "B": 2, "N": 6, **base})
    # a short prompt (two tokens per rank at D = 4), batch 1, more steps than ranks
    for strat in ("tsp", "sp"):
        cases.append({"id": f"{strat}-D4-P8-B1", "strategy": strat, "D": 4, "P": 8, "B": 1,
                      "N": 10})  # fmt: skip
    # TSP prefill under its other schedules: broadcast MLP, overlap off, KV buckets
    cases.append({"id": "tsp-D4-mlp-broadcast-overlap0", "strategy": "tsp", "D": 4, "P": 16,
                  "B": 2, "N": 5, "mlp_schedule": "broadcast", "overlap": False})  # fmt: skip
    cases.append({"id": "tsp-D2-bucket1", "strategy": "tsp", "D": 2, "P": 16, "B": 2, "N": 5,
                  "kv_bucket": 1, "model": MODELS["gqa"]})  # fmt: skip
    # TSP's prefill with each head group's K/V passed round the ring (kv_exchange=ring)
    for D, model in ((2, "mha"), (4, "gqa")):
        cases.append({"id": f"tsp-D{D}-{model}-kv-ring", "strategy": "tsp", "D": D, "P": 16,
                      "B": 2, "N": 5, "kv_exchange": "ring", "model": MODELS[model]})  # fmt: skip
    # SP's and TP+SP's prefill over the Ulysses all-to-alls (cp_comm=a2a) and the ring
    # (cp_comm=ring): the cache keeps the same K/V
    for comm in ("a2a", "ring"):
        for D, model in ((2, "mha"), (4, "gqa")):
            cases.append({"id": f"sp-D{D}-{model}-{comm}", "strategy": "sp", "D": D, "P": 16,
                          "B": 2, "N": 5, "cp_comm": comm, "model": MODELS[model]})  # fmt: skip
        for T, Sigma, model in ((1, 2, "mha"), (2, 2, "gqa")):
            cases.append({"id": f"tpsp-D{T}x{Sigma}-{model}-{comm}", "strategy": "tpsp",
                          "D": T * Sigma, "tp": T, "sp": Sigma, "P": 16, "B": 2, "N": 5,
                          "cp_comm": comm, "model": MODELS[model]})  # fmt: skip
    # and a2a+p2p: the all-to-all inside pairs of ranks, the ring across the two pairs
    cases.append({"id": "sp-D4-gqa-a2a+p2p", "strategy": "sp", "D": 4, "P": 16, "B": 2, "N": 5,
                  "cp_comm": "a2a+p2p", "model": MODELS["gqa"]})  # fmt: skip
    cases.append({"id": "tpsp-D1x4-mha-a2a+p2p", "strategy": "tpsp", "D": 4, "tp": 1, "sp": 4,
                  "P": 16, "B": 2, "N": 5, "cp_comm": "a2a+p2p"})  # fmt: skip
    # bf16 (small: bf16 matmul is ~90x slower than fp32 on this CPU), GQA, kv_heads < T for TP
    for strat, lay, model in [
        ("single", {"D": 1}, "gqa"), ("tsp", {"D": 2}, "gqa"), ("tsp", {"D": 4}, "gqa"),
        ("tp", {"D": 4}, "kv2"), ("sp", {"D": 4}, "gqa"),
        ("tpsp", {"D": 4, "tp": 2, "sp": 2}, "gqa"),
    ]:  # fmt: skip
        cases.append({"id": f"{strat}-D{lay['D']}-{model}-bf16", "strategy": strat, "P": 16,
                      "B": 2, "N": 4, "model": MODELS[model], "dtype": "bf16", **lay})  # fmt: skip
    for D in (2, 4):
        cases.append({"id": f"tsp-D{D}-wide", "strategy": "tsp", "D": D, "P": 16, "B": 2, "N": 5,
                      "model": WIDE})  # fmt: skip
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def results() -> dict:
    return run_world(4, "tests.helpers.decode_checks:run_decode_cases", CASES)[0]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_generation_equals_reference(results, case):
    res = results[case["id"]]
    assert res["tokens_equal"], res["tokens"]
    assert res["logits_close"], f"max relative error {res['logits_err']:.3g}"


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_bytes_per_step_equal_closed_form(results, case):
    """Every decode step's bytes, and the prefill's (its forward without the loss, then the
    last position's hidden state and the greedy pick), by collective kind."""
    res = results[case["id"]]
    assert res["bytes_exact"], f"counted {res['bytes']}, closed form {res['expect']}"
    assert res["prefill_bytes"] == res["prefill_expect"]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_cache_bytes_and_balance(results, case):
    res = results[case["id"]]
    assert res["cache_bytes"] == res["cache_expect"]
    assert res["balanced"]


@pytest.mark.parametrize("D", [2, 4])
def test_tsp_moves_no_weights_per_token(results, D):
    narrow, wide = results[f"tsp-D{D}-mha"], results[f"tsp-D{D}-wide"]
    assert narrow["expect"] == wide["expect"]
    for step in (*narrow["bytes"], *wide["bytes"]):
        assert step == narrow["bytes"][0]
        assert set(step) <= {"all_gather", "all_reduce", "reduce_scatter"}


def test_kv_heads_replicated_below_T(results):
    """TP at D = 4 with fewer than 4 KV heads still caches one whole head per rank (replicated
    on 4/n_kv ranks), as many bytes as with 4 heads; SP splits by sequence: 1/4 with 1 head
    (the GQA model's heads are twice as wide: head_dim 16 against hidden/heads = 8)."""
    four = results["tp-D4-gqa"]["cache_bytes"] // 2
    assert results["tp-D4-kv2"]["cache_bytes"] == four
    assert results["tp-D4-kv1"]["cache_bytes"] == four
    assert results["sp-D4-kv1"]["cache_bytes"] * 4 == results["sp-D4-gqa"]["cache_bytes"] // 2
