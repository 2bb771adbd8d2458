"""Overlap is a property of each scheduled collective (``Event.overlapped``), set by each strategy's
``schedule()`` for exactly what its code overlaps; the cost model hides those events and no
others (docs/projection.md, "Overlap, per event")."""

from __future__ import annotations

from collections import Counter

import pytest

from tspbench.core.config import get_config
from tspbench.projection import analytic
from tspbench.projection.costmodel import load_preset, project
from tspbench.runtime.spec import RunSpec

CFG = get_config("7b")
L, D = CFG.layers, 8


def _spec(strategy: str, **kw) -> RunSpec:
    return RunSpec.make(strategy, CFG, degree=D, seq_len=16384, dtype="bf16", **kw)


def _overlapped(spec: RunSpec) -> Counter:
    """(phase, kind, full tensor bytes) of the overlapped events, counted."""
    return Counter((ev[0], ev[2], ev[4]) for ev in analytic.schedule(spec) if ev.overlapped)


@pytest.mark.parametrize("strategy", ["fsdp_cp", "tsp"])
@pytest.mark.parametrize("rc", ["none", "full"])
def test_overlap_moves_no_byte(strategy, rc):
    on, off = _spec(strategy, recompute=rc), _spec(strategy, recompute=rc, overlap=False)
    assert analytic.comm_bytes(on) == analytic.comm_bytes(off)
    assert _overlapped(on)
    if strategy == "fsdp_cp":  # blocking collectives only
        assert not _overlapped(off)


@pytest.mark.parametrize("rc", ["none", "full"])
def test_fsdp_cp_hides_its_units_not_its_kv(rc):
    """Prefetched unit gathers (all but the first of each pass) and drained reduce-scatters (all
    but the embedding's, the last); the K/V all-gathers and reduce-scatters stay critical."""
    from baselines.fsdp_cp import FSDPCP

    spec = _spec("fsdp_cp", recompute=rc)
    u0, ul, un = FSDPCP.costs.unit_bytes(spec)
    got = _overlapped(spec)
    want = Counter({("forward", "all_gather", float(ul)): L,
                    ("forward", "all_gather", float(un)): 1,
                    ("backward", "all_gather", float(ul)): L - (rc == "full"),
                    ("backward", "reduce_scatter", float(ul)): L,
                    ("backward", "reduce_scatter", float(un)): 1})  # fmt: skip
    assert got == want
    kv = 2 * spec.seq_len * CFG.kv_dim * spec.e  # one layer's K and V, whole sequence
    assert all(not ev.overlapped for ev in analytic.schedule(spec) if ev[4] == kv)
    assert float(u0) not in {nbytes for _, _, nbytes in got}


@pytest.mark.parametrize("strategy", ["tp", "sp", "dp", "tpsp"])
def test_baselines_without_overlap_hide_nothing(strategy):
    kw = {"tp": 4, "sp": 2} if strategy == "tpsp" else {}
    spec = RunSpec.make(strategy, CFG, degree=D, seq_len=16384, dtype="bf16",
                        batch=D if strategy == "dp" else 1, **kw)  # fmt: skip
    assert not _overlapped(spec)
    p = project(spec, load_preset("h100"), ops=0)
    assert p["comm_overlappable_s"] == p["comm_hidden_s"] == 0


def test_the_data_parallel_all_reduce_is_overlapped():
    spec = _spec("tp", dp=4)
    (ev,) = [ev for ev in analytic.schedule(spec) if ev[1] == "dp"]
    assert ev.overlapped


def test_tsp_waits_for_each_loops_first_broadcast():
    """Broadcast MLP, forward: per layer D attention and D MLP broadcasts, D each for the
    embedding and the head; the first of each loop is waited for at once."""
    spec = _spec("tsp", mlp_schedule="broadcast", mode="infer")
    bcasts = [ev for ev in analytic.schedule(spec) if ev[2] == "broadcast"]
    assert len(bcasts) == (2 * L + 2) * D
    assert sum(ev.overlapped for ev in bcasts) == (2 * L + 2) * (D - 1)
    off = _spec("tsp", mlp_schedule="broadcast", mode="infer", overlap=False)
    assert not _overlapped(off)


def test_the_cost_model_hides_fsdp_cp_units_only_with_overlap():
    preset = load_preset("mi300x")
    on = project(_spec("fsdp_cp", recompute="full"), preset, ops=0)
    off = project(_spec("fsdp_cp", recompute="full", overlap=False), preset, ops=0)
    assert off["comm_overlappable_s"] == off["comm_hidden_s"] == 0
    assert on["comm_hidden_s"] > 0 and on["step_time_s"] < off["step_time_s"]
    total = on["comm_critical_s"] + on["comm_overlappable_s"]
    assert total == pytest.approx(off["comm_critical_s"])
