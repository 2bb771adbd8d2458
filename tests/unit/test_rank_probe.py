"""The doctor's rank probe: which cells it takes, and that a wrong estimate or a crash is a
FAILED line that leaves no process group behind (every strategy's probe on CPU:
tests/integration/test_rank_probe.py)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from tspbench.core.config import get_config
from tspbench.pipeline import rank_probe as rp
from tspbench.runtime.registry import strategies

CELL = ("tiny", 1, 128, "fp32")


def test_every_strategy_is_probed_at_d8_and_the_reference_skipped():
    """From the registry: each strategy that takes D = 8 (a factored one at its folded
    factorisations), the single-device reference skipped, saying why."""
    assert rp.factor_pairs(8) == [[2, 4], [4, 2]] and rp.factor_pairs(2) == [[1, 2], [2, 1]]
    cells = rp.probe_specs(torch.device("cpu"), 8, CELL)
    probed = {spec.strategy for _, spec, _ in cells if spec is not None}
    assert probed == {n for n, s in strategies().items() if not s.reference}
    assert all(spec.degree == 8 and spec.dtype == "fp32" for _, spec, _ in cells if spec)
    skipped = [(name, why) for name, spec, why in cells if spec is None]
    assert skipped[-1] == (
        "rank probe single D=8",
        "the single-device reference: D = 8 makes no sense",
    )
    # and the one variant whose layout refuses it, saying why: a2a+p2p over Sigma = 2 has no
    # inner group below 2
    assert [name for name, _ in skipped[:-1]] == [
        "rank probe tpsp (4x2) {'cp_comm': 'a2a+p2p'} D=8 (tiny)"
    ]
    assert skipped[0][1].startswith("cp_a2a=0 (the largest that fits): none does")


def test_each_choice_of_a_strategy_is_probed_as_its_own_cell():
    """A sweep may run any value of a strategy's choice options (TSP's MLP schedule, SP's K/V
    exchange): each is a cell of its own, named by its label, one option at a time."""
    dense, experts = get_config("tiny"), get_config("tiny", experts=4, top_k=2)
    for name, impl in strategies().items():
        choices = sum(len(o.choices) - 1 for o in impl.options if o.choices)
        only = sum(len(o.choices) - 1 for o in impl.options if o.choices and o.experts_only)
        assert len(rp.variants(impl, experts)) == 1 + choices, name
        assert len(rp.variants(impl, dense)) == 1 + choices - only, name  # (none for dense)
    names = [n for n, spec, _ in rp.probe_specs(torch.device("cpu"), 8, CELL, ["sp"]) if spec]
    assert names == [f"rank probe sp{v} D=8 (tiny, 1 layer, S=128, fp32)"
                     for v in ("", " (a2a)", " (ring)", " (a2a+p2p)")]  # fmt: skip


def test_the_probe_times_its_steps_and_their_issue():
    """Steady steps timed beside their host issue (a CPU's clock is both: they are equal)."""
    _, res = rp.rank_probe(torch.device("cpu"), 8, CELL, ["tp"], echo=False)
    assert res[0]["step_s"] > 0 and res[0]["issue_s"] == res[0]["step_s"]
    assert "s without communication (host issue" in res[0]["detail"]


def test_a_cell_a_strategy_refuses_is_skipped_saying_why():
    cells = rp.probe_specs(torch.device("cpu"), 8, ("tiny", 1, 100, "fp32"), ["tsp", "tp"])
    (tsp, spec, why), (tp, tp_spec, _) = cells
    assert spec is None and "zigzag" in why and tsp == "rank probe tsp D=8 (tiny)"
    assert tp_spec is not None and tp == "rank probe tp D=8 (tiny, 1 layer, S=100, fp32)"


def test_a_wrong_estimate_fails_and_the_group_is_gone(monkeypatch, tmp_path):
    """An estimate twice the measured peak is FAILED with its ratio; the results name it, the
    JSON holds them, and a real group can be made afterwards."""
    real = rp.estimate

    def doubled(spec, ranks, kernel, backend=None):
        out = real(spec, ranks, kernel, backend)
        return {**out, "peak_mem_bytes": 2 * out["peak_mem_bytes"]}

    monkeypatch.setattr(rp, "estimate", doubled)
    out = tmp_path / "probe.json"
    checks, res = rp.rank_probe(torch.device("cpu"), 8, CELL, ["tp"], out, echo=False)
    assert [c.status for c in checks] == ["FAILED"]
    assert "(0.50x)" in checks[0].detail and "outside [0.75, 1.33]" in checks[0].detail
    assert res[0]["status"] == "FAILED" and abs(res[0]["ratio"] - 0.5) < 1e-9
    assert json.loads(out.read_text())["rank_probe"][0]["tag"] == "tp"
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.destroy_process_group()


def test_a_crash_in_the_probe_is_failed_and_destroys_the_group(monkeypatch):
    def boom(*_, **__):
        raise RuntimeError("boom")

    monkeypatch.setattr(rp, "probe", boom)
    checks, res = rp.rank_probe(torch.device("cpu"), 8, CELL, ["tsp"], echo=False)
    assert checks[0].status == "FAILED" and "RuntimeError: boom" in checks[0].detail
    assert "ratio" not in res[0] and not dist.is_initialized()
