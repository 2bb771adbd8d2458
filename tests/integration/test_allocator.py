"""The memory tracker against the allocator (issue 35): for every registered strategy, the
tracked peak of a steady-state training step against the high-water mark of torch's own
allocator events over the same step (the profiler's, every thread included).

The tracker sees what is dispatched. Gloo also holds staging buffers no dispatch mode can follow
(an all-gather's, the size of its output, on its worker thread; a reduce-scatter's copy of its
input), which :mod:`tspbench.core.comm` counts from the issue to the wait, the same for every
strategy. The allocator frees an all-gather's when the work completes (an FSDP prefetch can
complete long before its wait: the tracked peak is then above the allocator's), and a staging
buffer can outlive the wait by a scheduler tick (the allocator's then above, at random, by at
most that buffer).

The model has few tokens and wide units (small, S = 512) so that gathered weights weigh: without
the staging counted, FSDP+CP's allocator peak was 17-24% above its tracked peak here.
"""

from __future__ import annotations

import statistics

from tests.helpers.distributed import run_world
from tspbench.runtime.registry import strategies

WORLD = 4
SMALL = {"vocab": 4096, "hidden": 256, "layers": 4, "ffn": 1024}


def _cases() -> list[dict]:
    """Each strategy at its first checked layout of degree 4 (the reference at 1, four side by
    side)."""
    cases = []
    for s, impl in strategies().items():
        by_degree = {lay.degree: lay for lay in reversed(impl.checked_layouts())}
        lay = by_degree[1 if impl.reference else WORLD]
        factors = {k: v for k, v in impl.factors(lay).items() if v is not None}
        B = impl.replica_batch(lay, 1)
        cases.append({"strategy": s, "D": lay.degree, "S": 512, "B": B, **factors,
                      "model": SMALL, "check": "allocator", "id": s})  # fmt: skip
    return cases


def test_tracked_peak_is_the_allocators_for_every_strategy():
    cases = _cases()
    ranks = run_world(WORLD, "tests.helpers.checks:run_cases", cases)
    ratios = {}
    for c in cases:
        for r, res in enumerate(ranks):
            got = res[c["id"]]
            ratio = got["allocator"] / got["tracked"]
            # measured here over 4 runs: 0.93-1.034 (the races above); 1.17-1.24 for FSDP+CP
            # before its staging was counted. One staging buffer outliving its wait puts the
            # allocator above by that buffer: FSDP2+CP at 1.12 (4 MiB, a unit's reduce-scatter
            # input) in 4 of 5 runs on 2026-12-06, on ranks 1-3 at random, 3 of 14 later
            over = got["allocator"] - got["tracked"]
            assert ratio >= 0.9 and over <= max(0.05 * got["tracked"], got["staged"]), (
                c["id"], r, got,
            )  # fmt: skip
            ratios[(c["id"], r)] = ratio
    # most ranks of most strategies have no staging buffer at their crest: the very bytes
    assert statistics.median(ratios.values()) == 1.0, ratios
