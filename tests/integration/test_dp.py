"""Every strategy composed with data parallelism equals the single-device reference fed the same
global batch; the rank layout keeps model groups inside nodes; bytes split model-group / dp."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.distributed import run_world
from tspbench.core.strategy import Layout
from tspbench.runtime.layout import rank_layout
from tspbench.runtime.registry import strategies

GQA = {"kv_heads": 4}
# world 4 = dp 2 x model group 2; tiny dp buckets exercise several overlapped bucket all-reduces
CASES = [
    {
        "id": f"{s}-dp2",
        "strategy": s,
        "D": 2,
        "dp": 2,
        "S": 32,
        "B": 2,
        "model": GQA,
        "dp_bucket_mb": 0.02,
    }
    for s, impl in strategies().items()  # each one-axis model group (TP+SP: SLOW, below)
    if not impl.reference and not impl.factored
] + [
    {"id": "single-dp4", "strategy": "single", "D": 1, "dp": 4, "S": 32, "B": 1},
    {
        "id": "tsp-dp2-one-bucket-recompute",
        "strategy": "tsp",
        "D": 2,
        "dp": 2,
        "S": 32,
        "B": 1,
        "recompute": "full",
    },
]
SLOW = [
    {
        "id": "tpsp-2x2-dp2",
        "strategy": "tpsp",
        "D": 4,
        "tp": 2,
        "sp": 2,
        "dp": 2,
        "S": 32,
        "B": 1,
        "model": GQA,
        "dp_bucket_mb": 0.02,
    }
]


@pytest.fixture(scope="module")
def results() -> dict:
    return run_world(4, "tests.helpers.checks:run_cases", CASES)[0]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_dp_composition_equals_reference(results, case):
    res = results[case["id"]]
    assert res["ok"], f"failed: {res.get('failed')}; errors {res['errors']}"
    assert res["errors"]["loss"] < 1e-5 and res["errors"]["grad_norm"] < 1e-5


@pytest.mark.slow
def test_tpsp_2x2_with_dp2_on_8_ranks():
    res = run_world(8, "tests.helpers.checks:run_cases", SLOW)[0]["tpsp-2x2-dp2"]
    assert res["ok"], res


def test_record_splits_model_group_and_dp_traffic(tmp_path):
    out = tmp_path / "r.json"
    cmd = [
        sys.executable,
        "-m",
        "tspbench",
        "run",
        "--strategy",
        "tsp",
        "--degree",
        "2",
        "--dp",
        "2",
        "--seq-len",
        "32",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--quiet",
        "--launch",
        "local",
        "--out",
        str(out),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert rec["dp"] == 2 and rec["world_size"] == 4 and rec["global_batch"] == 2
    assert rec["model_group"]["size"] == 2 and rec["model_group"]["groups"] == [[0, 1], [2, 3]]
    assert sum(len(r) for r in rec["rank_nodes"].values()) == 4
    assert rec["model_group_spans_nodes"] is False
    assert rec["comm_bytes_dp"] > 0 and rec["comm_bytes_model_group"] > 0
    total = rec["comm_bytes_dp"] + rec["comm_bytes_model_group"]
    assert total == pytest.approx(rec["comm_bytes_total"])
    # dp traffic is the all-reduce of this rank's gradient shard: 2(dp-1)/dp x its bytes
    assert rec["comm_bytes_dp"] == pytest.approx(rec["param_numel_per_rank"][0] * 4)


@pytest.mark.parametrize(
    "world, strategy, extra, groups, first, crossing",
    [
        (8, "tsp", ["--degree", "8"], 1, list(range(8)), 0),
        (64, "tpsp", ["--tp", "2", "--sp", "4"], 8, list(range(8)), 0),
        (1024, "tsp", ["--degree", "8"], 128, list(range(8)), 0),
        (1024, "fsdp_cp", ["--degree", "4"], 256, list(range(4)), 0),
        (48, "tsp", ["--degree", "6"], 8, list(range(6)), 4),  # 6 does not divide 8
    ],
)
def test_layout_listing(capsys, world, strategy, extra, groups, first, crossing):
    from tspbench.cli import main

    args = ["layout", "--world", str(world), "--gpus-per-node", "8", "--strategy", strategy]
    assert main([*args, *extra, "--json"]) == 0
    lay = json.loads(capsys.readouterr().out)
    assert len(lay["model_groups"]) == groups and lay["model_groups"][0] == first
    assert len(lay["dp_groups"]) == len(first)
    assert len(lay["crossing"]) == crossing
    assert sorted(r for g in lay["model_groups"] for r in g) == list(range(world))
    assert main([*args, *extra]) == 0
    text = capsys.readouterr().out
    assert ("WARNING" in text) == bool(crossing)


def test_dp_groups_hold_the_same_position_of_every_model_group():
    lay = rank_layout("tsp", Layout(degree=8, dp=128))
    assert lay.dp_groups[3] == list(range(3, 1024, 8))
