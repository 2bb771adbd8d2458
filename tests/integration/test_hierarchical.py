"""Megatron-Core's hierarchical exchange (``cp_comm=a2a+p2p``) beyond the shared equivalence
test's fp32 D = 4 cases: bf16 (loose), lengths whose zigzag chunks are odd (3 and 5 tokens, so
the inner group's chunks are 6 and 10), GQA with two KV heads (one per inner rank), overlap off,
TP+SP over Sigma = 4; and in a 6-rank world a ring of three groups (chunks in flight in both
passes) at an inner size below the largest that fits, and an inner group of three. Each equals
the single-device reference (loss, hidden states, gradients, three AdamW steps). Beyond the
machine's ranks, fake-tensor steps at D = 8 (rings of four and two groups, TP+SP 2 x 4) count
exactly the closed form's bytes. The smallest group is 4 ranks (an inner pair, a ring of two
pairs): D = 2 and 3 have no inner group below them, which tests/integration/test_cli.py checks
is refused in one line."""

from __future__ import annotations

import json

import pytest

from tests.helpers.distributed import run_world
from tests.helpers.runner import tspbench
from tspbench.core.config import get_config
from tspbench.projection import analytic
from tspbench.projection.estimate import estimate_rank
from tspbench.runtime.spec import RunSpec

H = {"cp_comm": "a2a+p2p"}
CASES = [
    {"id": "sp-gqa-bf16", "strategy": "sp", "S": 16, "B": 1, "dtype": "bf16",
     "model": {"kv_heads": 2}},
    {"id": "sp-mha-S24", "strategy": "sp", "S": 24, "B": 2},
    {"id": "fsdp_cp-gqa-S40-overlap-off", "strategy": "fsdp_cp", "S": 40, "B": 2,
     "overlap": False, "model": {"kv_heads": 2, "qk_norm": True, "head_dim": 16}},
    {"id": "fsdp2_cp-S24-a2a2", "strategy": "fsdp2_cp", "S": 24, "B": 2, "cp_a2a": 2},
    {"id": "tpsp-1x4-gqa-bf16", "strategy": "tpsp", "tp": 1, "sp": 4, "S": 16, "B": 1,
     "dtype": "bf16", "model": {"kv_heads": 2}},
]  # fmt: skip
CASES = [{"D": 4, **H, **c} for c in CASES]
# six heads 16 wide: inner pairs and a ring of three (the largest inner size is 3), and inner
# triples with three KV heads (one each) and a ring of two
SIXTHS = {"heads": 6, "kv_heads": 6, "head_dim": 16}
SIX = [
    {"id": "sp-D6-a2-ring3", "strategy": "sp", "D": 6, "S": 24, "B": 2, "cp_a2a": 2,
     "model": SIXTHS},
    {"id": "fsdp_cp-D6-a3-gqa-recompute", "strategy": "fsdp_cp", "D": 6, "S": 36, "B": 1,
     "recompute": "full", "model": {**SIXTHS, "kv_heads": 3}},
]  # fmt: skip
SIX = [{**H, **c} for c in SIX]


@pytest.fixture(scope="module")
def results() -> dict:
    return run_world(4, "tests.helpers.checks:run_cases", CASES)[0]


@pytest.fixture(scope="module")
def six() -> dict:
    return run_world(6, "tests.helpers.checks:run_cases", SIX)[0]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_a2a_p2p_equals_reference(results, case):
    r = results[case["id"]]
    assert r["ok"], r


@pytest.mark.parametrize("case", SIX, ids=[c["id"] for c in SIX])
def test_a2a_p2p_equals_reference_over_six_ranks(six, case):
    r = six[case["id"]]
    assert r["ok"], r


@pytest.mark.parametrize(
    "strategy,tp,cp_a2a", [("sp", 1, 2), ("sp", 1, 4), ("fsdp_cp", 1, 2), ("tpsp", 2, 2)]
)
def test_fake_bytes_at_d8_equal_the_closed_form(strategy, tp, cp_a2a):
    factors = {"tp": tp, "sp": 8 // tp} if strategy == "tpsp" else {}
    spec = RunSpec.make(
        strategy, get_config("tiny"), degree=8, seq_len=64, batch=1, recompute="full",
        cp_comm="a2a+p2p", cp_a2a=cp_a2a, warmup=0, steps=1, **factors,
    )  # fmt: skip
    got = estimate_rank(spec, 0, "cpu_flash")["comm_by_kind"]
    want = analytic.comm_by_kind(spec)
    assert {k: v for k, v in got.items() if v} == {k: v for k, v in want.items() if v}
    assert got["send_recv"] > 0 and got["all_to_all"] > 0


def test_overlap_benchmark_traces_the_inner_and_outer_groups(tmp_path):
    """``tspbench overlap`` walks the mesh's comms to trace, replay and skip a step's
    collectives: the a2a+p2p groups are among them, so it sees every collective the closed
    form counts (before, it saw only the gradient all-reduce and timed the exchange as
    compute)."""
    out = tmp_path / "ov.json"
    args = ["--strategy", "sp", "--model", "tiny", "--degree", "4", "--seq-len", "256"]
    p = tspbench("overlap", *args, "--cp-comm", "a2a+p2p", "--steps", "1", "--launch", "local",
                 "--nproc", "4", "--out", out)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    spec = RunSpec.make("sp", get_config("tiny"), degree=4, seq_len=256, batch=1, cp_comm="a2a+p2p")
    assert json.loads(out.read_text())["collectives_per_step"] == len(analytic.schedule(spec))
