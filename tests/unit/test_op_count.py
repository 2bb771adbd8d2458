"""Dispatched operations per training step, TSP's and TP's (issue 16).

Counted as ``tspbench project`` counts them (``costmodel.count_ops``: aten operations but views
and metadata, on fake tensors, rank 0, a steady-state step, extrapolated over the layers), for
the issue's case: 7B, D = 8, S = 16384, bf16, full recomputation. The cost model charges every
operation its dispatch overhead, so this pins the packing of tsp_impl (one QKV GEMM, in-place
RoPE, packed K/V gathers and gradient scatters, reused broadcast buffers...; docs/method.md
sections 3 to 5) and the baseline's own count against silently regressing, each with 2% to
spare.

Measured: TSP 16,619 (ring MLP) and 16,555 (broadcast), TP 4,794: 3.45x. The issue asked for at
most 2x TP's count, 9,475 then. Since, every strategy got what standard implementations have and
TSP had first: one multi-tensor gradient norm and unpacking (TP to 7,992), and torch's fused
AdamW, one kernel over a rank's tensors (TP to 4,794; TSP from 17,993: it packs its weights into
four tensors per layer where TP has nine, so per-tensor AdamW had charged TP more). What is left
is TSP's loop over D head groups and D MLP slices per pass, each with two zigzag chunks
(docs/projection.md).
"""

from __future__ import annotations

import pytest

from tspbench.core.config import get_config
from tspbench.projection.costmodel import count_ops
from tspbench.runtime.spec import RunSpec

CASE = {"degree": 8, "seq_len": 16384, "dtype": "bf16", "recompute": "full"}
MEASURED = {("tsp", "ring"): 16619, ("tsp", "broadcast"): 16555, ("tp", "ring"): 4794}


@pytest.mark.parametrize("strategy, mlp", list(MEASURED))
def test_dispatched_operations_do_not_regress(strategy, mlp):
    n = count_ops(RunSpec.make(strategy, get_config("7b"), mlp_schedule=mlp, **CASE))
    assert n <= 1.02 * MEASURED[strategy, mlp], f"{strategy} ({mlp} MLP): {n} ops per step"
