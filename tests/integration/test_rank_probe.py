"""The doctor's rank probe on CPU: rank 0 of every registered strategy at D = 8 runs for real
on the fake process group, and its tracked peak is the fake-tensor estimate's (on a CPU both
count the same tensors of the same ops: a bound on the ratio checks that the real and the fake
run take the same code path); twice in one process."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tspbench.pipeline.check import in_bound
from tspbench.pipeline.rank_probe import rank_probe
from tspbench.runtime.registry import strategies

CELL = ("tiny", 2, 256, "fp32")


def test_every_strategy_probes_ok_within_the_bound(report):
    checks, res = rank_probe(torch.device("cpu"), 8, CELL, echo=False)
    assert not dist.is_initialized()  # destroyed after each strategy's rank
    status = {r["name"]: r["status"] for r in res}
    ran = [r for r in res if r["status"] != "skipped"]
    want = {n for n, s in strategies().items() if not s.reference}
    assert {r["strategy"] for r in ran} == want
    # the reference, and the one variant a layout refuses (a2a+p2p over TP+SP 4x2's Sigma = 2)
    skipped = {
        n: s for n, s in status.items() if "single" in n or "(4x2) {'cp_comm': 'a2a+p2p'}" in n
    }
    assert len(skipped) == 2, status
    assert all(s == "ok" for n, s in status.items() if n not in skipped), status
    assert all(s == "skipped" for s in skipped.values()), status
    assert all(in_bound(r["ratio"]) for r in ran)
    assert all(abs(r["ratio"] - 1) < 1e-9 for r in ran)  # CPU: the same tensors, to the byte
    report("rank probe on CPU", "\n".join(c.line() for c in checks))
