"""Paper scale in-process: the fake-tensor estimator on its worst rank, exact operation counts,
the cost model against its presets and the project-check table."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from tests.helpers.runner import ROOT
from tspbench.core.config import get_config
from tspbench.runtime.spec import RunSpec

REF = ROOT / "results" / "reference" / "calibration"


def test_op_count_extrapolates_exactly():
    from tspbench.projection.costmodel import count_ops
    from tspbench.projection.estimate import count_rank_ops

    cfg = dataclasses.replace(get_config("tiny"), layers=3)
    c = RunSpec.make("tsp", cfg, degree=2, seq_len=256, recompute="full")
    assert count_ops(c) == count_rank_ops(c)


def test_projection_parts_follow_the_preset():
    from tspbench.projection.costmodel import load_preset, project

    cfg = get_config("7b")
    mi, h100 = load_preset("mi300x"), load_preset("h100")
    tsp = RunSpec.make("tsp", cfg, degree=8, seq_len=65536, dtype="bf16", recompute="full")
    a, b = project(tsp, mi, ops=0), project(tsp, h100, ops=0)
    assert a["compute_s"] < b["compute_s"]  # MI300X has more FLOP/s than H100
    assert 0 < a["mfu"] < 1 and a["tokens_per_s"] > 0
    # a ring step uses one Infinity Fabric link, a broadcast all seven: on NVSwitch both see
    # the same bandwidth, so TSP's send/recv costs relatively more on MI300X
    scaled = project(tsp.replace(layout=dataclasses.replace(tsp.layout, dp=16)), mi, ops=0)
    assert scaled["step_time_s"] > a["step_time_s"]  # the data-parallel all-reduce crosses NICs


def test_links_and_algorithms_per_topology():
    """Seconds per byte of the full tensor, per link: a ring hop uses one link on either fabric;
    on the fully connected MI300X a broadcast or reduce of g ranks uses the g-1 links to its
    peers, as do the other collectives; on NVSwitch every rank has one port, and a broadcast
    moves the whole tensor through it (a pipelined ring)."""
    from tspbench.core.comm import bus_bytes
    from tspbench.projection.costmodel import fabric, load_preset

    mi, h100 = load_preset("mi300x"), load_preset("h100")
    link_mi, link_h = (p["link_bandwidth"] * p["bus_efficiency"] for p in (mi, h100))
    n = 1e9

    def secs(preset: dict, kind: str, g: int) -> float:
        return bus_bytes(kind, n, g) / fabric(preset, g)[kind]["bw"]

    for g in (2, 4, 8):
        assert secs(mi, "send_recv", g) == pytest.approx(n / link_mi)
        assert secs(h100, "send_recv", g) == pytest.approx(n / link_h)
        for kind in ("broadcast", "reduce"):
            assert secs(mi, kind, g) == pytest.approx(n / ((g - 1) * link_mi))
            assert secs(h100, kind, g) == pytest.approx(n / link_h)
        assert secs(mi, "all_gather", g) == pytest.approx((g - 1) / g * n / ((g - 1) * link_mi))
        assert secs(h100, "all_gather", g) == pytest.approx((g - 1) / g * n / link_h)


def test_tsp_mlp_schedule_default_follows_the_preset():
    """MI300X: the broadcast MLP (one owner drives all seven links) beats the ring (one link per
    hop) and is what TSP picks from its topology (a full mesh); H100/H200: the ring moves one
    slice less per pass at the same port bandwidth, and is what a switch gets. Baselines have
    no schedule: a preset chooses nothing for them."""
    from tspbench.projection.costmodel import load_preset, project

    cfg = get_config("7b")
    tsp = RunSpec.make("tsp", cfg, degree=8, seq_len=16384, dtype="bf16", recompute="full")
    bcast = tsp.replace(mlp_schedule="broadcast")
    for hw, best in (("mi300x", "broadcast"), ("h100", "ring"), ("h200", "ring")):
        preset = load_preset(hw)
        # all the traffic: each broadcast loop's first transfer is on the critical path
        ring_s, bcast_s = (
            sum(project(c, preset, ops=0)[k] for k in ("comm_overlappable_s", "comm_critical_s"))
            for c in (tsp, bcast)
        )
        assert (bcast_s < ring_s) == (best == "broadcast"), hw
        assert tsp.preset_options(preset).options["mlp_schedule"] == best
        assert "tsp_mlp_schedule" not in preset  # a fact (the topology), not a strategy's choice
        tp = RunSpec.make("tp", cfg, degree=8, seq_len=16384)
        assert tp.preset_options(preset) == tp and not tp.options


def test_project_check_reads_repeated_runs(tmp_path):
    """Repeated runs of a sweep: the median is the measurement, the range is reported."""
    from tspbench.projection.costcheck import check_footer, check_summary
    from tspbench.projection.costmodel import load_preset

    ref = pd.read_csv(REF / "default-summary-1.csv")
    cells = ref[ref["status"] == "ok"].head(3)
    paths = []
    for k, scale in enumerate((1.0, 1.5, 0.5)):
        run = cells.assign(step_time_s=cells["step_time_s"] * scale)
        paths.append(tmp_path / f"run{k}.csv")
        run.to_csv(paths[-1], index=False)
    table = check_summary([str(p) for p in paths], load_preset(str(REF / "cpu-2c.json")))
    assert list(table["runs"]) == [3] * 3
    assert table["measured_s"].tolist() == pytest.approx(cells["step_time_s"].tolist())
    assert table["spread"].tolist() == pytest.approx([2.0] * 3)
    assert table["inside_range"].all()  # projections within 2x of the measurement here
    assert "inside the measured range: 3/3" in check_footer(table)


def test_a_rows_rival_is_another_strategys_fastest_row(monkeypatch):
    """ratio_ranges weighs each row against the fastest row of another strategy: TSP's ring
    row is not weighed against TSP's all-gather row (a variant is not an alternative), at every
    corner; where every row is one strategy's, against the fastest other row."""
    from tspbench.projection import costmodel

    cfg = get_config("tiny")

    def case(strategy: str, **options) -> RunSpec:
        return RunSpec.make(strategy, cfg, degree=2, seq_len=64, options=options)

    tsp, tsp_ring, sp = case("tsp"), case("tsp", kv_exchange="ring"), case("sp")
    speed = {  # tokens/s at two corners
        (tsp, 0): 100.0, (tsp_ring, 0): 90.0, (sp, 0): 50.0,
        (tsp, 1): 100.0, (tsp_ring, 1): 120.0, (sp, 1): 200.0,
    }  # fmt: skip
    preset = {"rate_ranges": {"x": [0, 1]}}
    monkeypatch.setattr(
        costmodel, "project", lambda c, corner, n=None: {"tokens_per_s": speed[c, corner["x"]]}
    )
    got = costmodel.ratio_ranges([(tsp, 1), (tsp_ring, 1), (sp, 1)], preset)
    assert got == [(0.5, 2.0), (0.6, 1.8), (0.5, 200 / 120)]  # (SP against either TSP row)
    # one strategy only: the other row
    assert costmodel.ratio_ranges([(tsp, 1), (tsp_ring, 1)], preset) == [
        (100 / 120, 100 / 90), (0.9, 1.2)
    ]  # fmt: skip
