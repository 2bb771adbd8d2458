"""Projection tests that search or estimate for real (about 40 s here: outside the unit loop):
the estimator's worst rank, and the planner's fit decisions against a preset's usable memory."""

from __future__ import annotations

import dataclasses

from tspbench.core.config import get_config
from tspbench.projection import costmodel
from tspbench.projection.estimate import estimate_rank
from tspbench.projection.plan import search
from tspbench.projection.plan.types import Request
from tspbench.runtime.registry import strategies
from tspbench.runtime.spec import RunSpec


def test_rank_zero_holds_the_largest_buffers():
    """The estimator's default (rank 0) is the worst rank: zigzag gives it the longest keys.
    Every strategy at its checked group of 4 ranks; one layer: the keys a rank holds are the
    same in every layer (half the fake steps)."""
    cfg = dataclasses.replace(get_config("tiny"), layers=1)
    for s, impl in strategies().items():
        lay = next((lay for lay in impl.checked_layouts() if lay.degree == 4), None)
        if lay is None:
            continue  # (the reference: one rank)
        spec = RunSpec.make(s, cfg, degree=4, tp=lay.tp, sp=lay.sp, seq_len=1024,
                            batch=impl.replica_batch(lay, 1))  # fmt: skip
        peaks = [estimate_rank(spec, r, "fused")["peak_bytes"] for r in range(4)]
        assert peaks[0] == max(peaks), (s, peaks)


def test_fit_decisions_use_the_usable_memory_not_the_nominal_size():
    """A device exposes less than its nominal size, and the context, the collectives' buffers,
    the BLAS workspaces and the allocator's slack come off that: the planner's default cap is
    the preset's usable memory, so its pick leaves real headroom (7B, 128K, 8 H100: it picked
    TSP at 79.6 GiB against the nominal 80 GiB before)."""

    for name in ("h100", "h200", "mi300x"):
        p = costmodel.load_preset(name)
        u = p["usable_memory"]
        assert costmodel.usable_memory(p) < u["visible_bytes"] <= p["memory_bytes"]
        assert costmodel.usable_memory(p) < 0.96 * u["visible_bytes"]
    req = Request.make("7b", "h100", 131072, 8)
    assert req.memory_cap == costmodel.usable_memory(costmodel.load_preset("h100"))
    best = search.plan(req, use_cache=False).best
    assert best is not None and best.fits and best.cand.peak <= req.memory_cap < 75 * 2**30
    # a calibrated preset (no breakdown: it measured the free memory) keeps its memory_bytes
    assert costmodel.usable_memory({"memory_bytes": 5.0}) == 5.0
