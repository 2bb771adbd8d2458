"""D = 8 (8 gloo ranks on 2 cores: slow): TSP and the baselines at the paper's node size."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_world

pytestmark = pytest.mark.slow

GQA8 = {"hidden": 128, "heads": 16, "kv_heads": 8}  # n_kv divisible by 8, GQA 2:1
CASES = [
    {"id": "tsp-D8-mha", "strategy": "tsp", "D": 8, "S": 32, "B": 2},
    {"id": "tsp-D8-gqa", "strategy": "tsp", "D": 8, "S": 48, "B": 1, "model": GQA8},
    {"id": "tp-D8", "strategy": "tp", "D": 8, "S": 32, "B": 1},
    {"id": "sp-D8", "strategy": "sp", "D": 8, "S": 32, "B": 1},
    {"id": "fsdp_cp-D8", "strategy": "fsdp_cp", "D": 8, "S": 32, "B": 1},
    {"id": "tpsp-2x4", "strategy": "tpsp", "D": 8, "tp": 2, "sp": 4, "S": 32, "B": 1},
    {"id": "tpsp-4x2", "strategy": "tpsp", "D": 8, "tp": 4, "sp": 2, "S": 32, "B": 1},
    {"id": "dp-D8", "strategy": "dp", "D": 8, "S": 16, "B": 8},
]


@pytest.fixture(scope="module")
def results() -> dict:
    return run_world(8, "tests.helpers.checks:run_cases", CASES)[0]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_d8_equals_reference(results, case):
    res = results[case["id"]]
    assert res["ok"], f"failed: {res.get('failed')}; errors {res['errors']}"
