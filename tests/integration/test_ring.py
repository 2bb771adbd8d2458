"""Context parallelism's exchanges at an odd degree: every strategy that declares ``cp_comm``,
at D = 3 (a 3-rank gloo world), each sequence-sharding exchange that splits 8 heads over 3
(all_gather, ring), MHA and GQA, a length that is not a power of two, and bf16 (loose), equals
the single-device reference (loss, hidden states, gradients, three AdamW steps); and so does
TSP's head-group K/V exchange (``kv_exchange``: all_gather, ring) at D = 3, on heads, vocabulary
and MLP that split 3 ways. The shared equivalence test checks D = 1, 2, 4."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_world
from tspbench.runtime.registry import strategies

D3 = [s for s, impl in strategies().items() if any(o.name == "cp_comm" for o in impl.options)]
# TSP splits every weight 3 ways: 6 heads 16 wide (Q 96 of h = 64), MLP 192, vocabulary 258
THIRDS = {"heads": 6, "kv_heads": 6, "head_dim": 16, "ffn": 192, "vocab": 258}


def _cases() -> list[dict]:
    cases = []
    for s in D3:
        impl = strategies()[s]
        # the group of 3 that splits the sequence 3 ways (TP+SP: T = 1 x Sigma = 3)
        lay = next(x for x in impl.sweep_layouts([3], [[1, 3]]) if impl.context_parallel(x) == 3)
        factors = {k: v for k, v in impl.factors(lay).items() if v is not None}
        for comm in ("all_gather", "ring"):
            base = {"strategy": s, "D": 3, "B": 2, "cp_comm": comm, **factors}
            cases += [
                {**base, "id": f"{s}-{comm}-mha-S30", "S": 30},
                {**base, "id": f"{s}-{comm}-gqa-S30", "S": 30, "model": {"kv_heads": 4}},
                {**base, "id": f"{s}-{comm}-gqa-bf16", "S": 12, "B": 1, "dtype": "bf16",
                 "model": {"kv_heads": 2}},
            ]  # fmt: skip
    for comm in ("all_gather", "ring"):
        base = {"strategy": "tsp", "D": 3, "B": 2, "kv_exchange": comm}
        cases += [
            {**base, "id": f"tsp-{comm}-mha-S30", "S": 30, "model": THIRDS},
            {**base, "id": f"tsp-{comm}-gqa-S30", "S": 30, "model": {**THIRDS, "kv_heads": 3}},
            {**base, "id": f"tsp-{comm}-gqa-bf16", "S": 12, "B": 1, "dtype": "bf16",
             "model": {**THIRDS, "kv_heads": 3}},
        ]  # fmt: skip
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def results() -> dict:
    return run_world(3, "tests.helpers.checks:run_cases", CASES)[0]


def test_registry_has_a_cp_comm_strategy():
    assert D3, "no registered strategy declares cp_comm"


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_equals_reference_at_d3(results, case):
    r = results[case["id"]]
    assert r["ok"], r
