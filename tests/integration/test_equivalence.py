"""Every strategy equals the single-device reference: loss, hidden states, all gradients, and the
weights after three AdamW steps (fp32: rtol 1e-4; bf16: see checks.BF16_TOL), at D in {1, 2, 4}
(tpsp at (T, Sigma) in {(2,1), (1,2), (2,2)}), MHA and GQA, batch 1 and 2; TSP with either MLP
schedule (ring, broadcast) and either attention backward (K/V gathered again, or saved);
FSDP+CP with its overlap (prefetch, asynchronous reduce-scatters) on and off.

One 4-rank gloo world runs every case (side-by-side model groups when D < 4).
"""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_world

MODELS = {"mha": {}, "gqa": {"kv_heads": 4}}
LAYOUTS = {
    "single": [{"D": 1}],
    "dp": [{"D": 1}, {"D": 2}, {"D": 4}],
    "tp": [{"D": 1}, {"D": 2}, {"D": 4}],
    "sp": [{"D": 1}, {"D": 2}, {"D": 4}],
    "tpsp": [{"D": 2, "tp": 2, "sp": 1}, {"D": 2, "tp": 1, "sp": 2}, {"D": 4, "tp": 2, "sp": 2}],
    "fsdp_cp": [{"D": 1}, {"D": 2}, {"D": 4}],
    "tsp": [{"D": 1}, {"D": 2}, {"D": 4}],
}


def _cases() -> list[dict]:
    cases = []
    for strat, layouts in LAYOUTS.items():
        for lay in layouts:
            for model, over in MODELS.items():
                for b in (1, 2):
                    B = b * lay["D"] if strat == "dp" else b  # dp gives each rank whole sequences
                    name = "x".join(str(lay[k]) for k in ("tp", "sp") if k in lay) or str(lay["D"])
                    cases.append(
                        {
                            "id": f"{strat}-D{name}-{model}-B{B}",
                            "strategy": strat,
                            "S": 32,
                            "B": B,
                            "model": over,
                            **lay,
                        }
                    )
    # a sequence length that is not a power of two (divisible by 2D = 8)
    for strat in ("tsp", "sp", "fsdp_cp", "tpsp"):
        extra = {"tp": 2, "sp": 2} if strat == "tpsp" else {}
        cases.append({"id": f"{strat}-D4-S24", "strategy": strat, "S": 24, "B": 2, "D": 4, **extra})
    # bf16: loose tolerances, small shapes (bf16 matmul is ~90x slower than fp32 on this CPU)
    for strat, lay in [
        ("tsp", {"D": 2}),
        ("tsp", {"D": 4}),
        ("tp", {"D": 4}),
        ("sp", {"D": 4}),
        ("fsdp_cp", {"D": 4}),
        ("tpsp", {"D": 4, "tp": 2, "sp": 2}),
        ("dp", {"D": 2}),
    ]:
        cases.append(
            {
                "id": f"{strat}-D{lay['D']}-gqa-bf16",
                "strategy": strat,
                "S": 16,
                "B": 2,
                "model": MODELS["gqa"],
                "dtype": "bf16",
                **lay,
            }
        )
    # TSP at full strength (overlap on is the default above): overlap off, head buckets, and
    # activation recomputation for every strategy
    for ov in (True, False):
        for kb in (1, 2):
            cases.append(
                {
                    "id": f"tsp-D2-overlap{int(ov)}-bucket{kb}",
                    "strategy": "tsp",
                    "D": 2,
                    "S": 32,
                    "B": 2,
                    "overlap": ov,
                    "kv_bucket": kb,
                }
            )
    cases.append(
        {
            "id": "tsp-D4-overlap0-gqa",
            "strategy": "tsp",
            "D": 4,
            "S": 32,
            "B": 2,
            "overlap": False,
            "model": MODELS["gqa"],
        }
    )
    # TSP's MLP schedules: every tsp case above runs the ring (the default); the broadcast one
    # at D 2 and 4, MHA and GQA, with overlap off and with recomputation (same world)
    bcast = {"strategy": "tsp", "S": 32, "B": 2, "mlp_schedule": "broadcast"}
    for D in (2, 4):
        for model, over in MODELS.items():
            cases.append({"id": f"tsp-mlp-broadcast-D{D}-{model}", "D": D, "model": over, **bcast})
    cases.append({"id": "tsp-mlp-broadcast-D4-overlap0-gqa", "D": 4, "overlap": False,
                  "model": MODELS["gqa"], **bcast})  # fmt: skip
    cases.append({"id": "tsp-mlp-broadcast-D4-recompute", "D": 4, "recompute": "full",
                  "model": MODELS["gqa"], **bcast})  # fmt: skip
    # TSP's attention backward keeping the forward's K/V (--kv-backward save): D 2 and 4, MHA
    # and GQA, with recomputation, KV buckets, overlap off and the broadcast MLP
    save = {"strategy": "tsp", "S": 32, "B": 2, "kv_backward": "save"}
    for D in (2, 4):
        for model, over in MODELS.items():
            cases.append({"id": f"tsp-kvsave-D{D}-{model}", "D": D, "model": over, **save})
    cases.append({"id": "tsp-kvsave-D4-recompute-gqa", "D": 4, "recompute": "full",
                  "model": MODELS["gqa"], **save})  # fmt: skip
    cases.append({"id": "tsp-kvsave-D2-bucket1-overlap0-mlp-broadcast", "D": 2, "kv_bucket": 1,
                  "overlap": False, "mlp_schedule": "broadcast", **save})  # fmt: skip
    for strat, lays in LAYOUTS.items():
        lay = lays[-1]
        B = 4 if strat == "dp" else 2
        cases.append(
            {
                "id": f"{strat}-recompute",
                "strategy": strat,
                "S": 32,
                "B": B,
                "recompute": "full",
                "model": MODELS["gqa"],
                **lay,
            }
        )
    cases.append(
        {
            "id": "tsp-D4-recompute-bucket1-overlap0",
            "strategy": "tsp",
            "D": 4,
            "S": 32,
            "B": 1,
            "recompute": "full",
            "kv_bucket": 1,
            "overlap": False,
        }
    )
    # FSDP+CP: its prefetch and asynchronous reduce-scatters are on above (the default, as in
    # fsdp_cp-D4-gqa-B2 and fsdp_cp-recompute); here off, with and without recomputation
    for rc in ("none", "full"):
        cases.append({"id": f"fsdp_cp-D4-overlap0-{rc}", "strategy": "fsdp_cp", "D": 4,
                      "S": 32, "B": 2, "recompute": rc, "overlap": False,
                      "model": MODELS["gqa"]})  # fmt: skip
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def results() -> dict:
    return run_world(4, "tests.helpers.checks:run_cases", CASES)[0]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_equals_reference(results, case):
    res = results[case["id"]]
    assert res["ok"], f"failed: {res.get('failed')}; errors {res['errors']}"


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c["B"] <= 2 and "dtype" not in c and "recompute" not in c],
    ids=lambda c: c["id"],
)
def test_parameter_elements_follow_the_layout(results, case):
    """dp/sp/single: whole model; tp/tpsp: 1/T (+ norms); tsp/fsdp_cp: 1/D (+ norms / padding)."""
    res = results[case["id"]]
    full, numel = res["ref_numel"], res["numel"]
    from tspbench.core.config import get_config

    cfg = get_config("tiny", **case.get("model", {}))
    norms = (2 * cfg.layers + 1) * cfg.hidden
    s, D = case["strategy"], case["D"]
    if s in ("single", "dp", "sp"):
        assert numel == full
    elif s in ("tp", "tpsp"):
        T = case.get("tp", D)
        assert numel == (full - norms) // T + norms
    elif s == "tsp":
        assert numel == (full - norms) // D + norms
    else:  # fsdp_cp: everything sharded, each unit padded to a multiple of D
        assert full // D <= numel <= full // D + (cfg.layers + 2)
    # AdamW state: two moments per local element (fp32 params: no master copy)
    assert res["opt_numel"] == 2 * numel
