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

    # the datasheet model, where a preset has no published curve (test below for the curves)
    mi, h100 = ({k: v for k, v in load_preset(n).items() if k != "collectives"}
                for n in ("mi300x", "h100"))  # fmt: skip
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


def test_a_published_curve_is_read_at_each_calls_size():
    """With a curve (nccl-tests' busbw against its size), a call costs what the benchmark timed
    for that size: exactly at a measured size, log-log between two, the smallest size's time
    below it (latency), the largest size's bandwidth above it; nccl-tests' bus factors (an
    all-reduce 2(n-1)/n, a broadcast 1); on a full mesh a smaller group drives fewer links."""
    from tspbench.projection.costmodel import call_time, fabric, load_preset

    rows = [[8, 0.0008, None], [1 << 20, 40.0, None], [1 << 30, 400.0, None]]  # (busbw only)
    sets = {k: [{"collective": k, "gpus": 8, "rows": rows}] for k in ("all_reduce", "broadcast")}
    h100 = load_preset("h100") | {"collectives": {"intra": sets}}
    ar = fabric(h100, 8)["all_reduce"]
    f = 2 * 7 / 8
    assert call_time(ar, "all_reduce", 1 << 20, 8) == pytest.approx(f * (1 << 20) / 40e9)
    assert call_time(ar, "all_reduce", 1, 8) == call_time(ar, "all_reduce", 8, 8)
    last, floor = f * (1 << 30) / 400e9, f * 8 / 0.8e6  # (above: the bandwidth above the floor)
    assert call_time(ar, "all_reduce", 1 << 32, 8) == pytest.approx(floor + 4 * (last - floor))
    mid = 1 << 25  # halfway in log size: busbw sqrt(40 x 400)
    assert call_time(ar, "all_reduce", mid, 8) == pytest.approx(f * mid / (40e9 * 400e9) ** 0.5)
    bc = fabric(h100, 8)["broadcast"]
    assert call_time(bc, "broadcast", 1 << 30, 8) == pytest.approx((1 << 30) / 400e9)
    # a switch: every group its port; a full mesh: a group of 4 drives 3 of the 7 links. Only
    # the part above the floor (the smallest size's time, a latency) converts and scales
    assert fabric(h100, 4)["all_reduce"]["curve"] == ar["curve"]
    mi = load_preset("mi300x") | {"collectives": {"intra": sets}}
    four, eight = fabric(mi, 4)["all_reduce"], fabric(mi, 8)["all_reduce"]
    assert call_time(four, "all_reduce", 8, 4) == call_time(eight, "all_reduce", 8, 8) == floor
    for n in (1 << 20, 1 << 25, 1 << 30):  # bus factor 1.5 against 1.75, 3 links against 7
        assert call_time(four, "all_reduce", n, 4) - floor == pytest.approx(
            1.5 / 1.75 * 7 / 3 * (call_time(eight, "all_reduce", n, 8) - floor)
        )
    # the stated uncertainty scales the bandwidth part; a kind read through another's curve
    # (a proxy) converts by the bus factors; without a curve: latency + bytes / bandwidth
    slow = fabric(h100 | {"collective_efficiency": 0.5}, 8)["all_reduce"]
    assert call_time(slow, "all_reduce", 1 << 30, 8) - floor == pytest.approx(
        2 * (call_time(ar, "all_reduce", 1 << 30, 8) - floor)
    )
    real = fabric(load_preset("h100"), 8)  # (a broadcast reads the all-gather's curve)
    t0 = real["all_gather"]["curve"][0][1]
    assert real["broadcast"]["curve"] == real["all_gather"]["curve"]
    assert call_time(real["broadcast"], "broadcast", 1 << 30, 8) - t0 == pytest.approx(
        8 / 7 * (call_time(real["all_gather"], "all_gather", 1 << 30, 8) - t0)
    )
    # times: busbw from them; a run's glitch (a smaller message slower than a larger one) is
    # read as the larger one's time
    timed = [[8, 0.0, 20.0], [1024, 0.0, 60.0], [2048, 0.0, 21.0], [1 << 30, 0.0, 2684.4]]
    ag4 = {"all_gather": [{"collective": "all_gather", "gpus": 4, "rows": timed}]}
    g = fabric(load_preset("h100") | {"collectives": {"intra": ag4}}, 4)["all_gather"]
    assert call_time(g, "all_gather", 1024, 4) == pytest.approx(21e-6)
    assert call_time(g, "all_gather", 1 << 30, 4) == pytest.approx(2684.4e-6)
    ag = fabric(h100, 8)["all_gather"]
    assert "curve" not in ag
    assert call_time(ag, "all_gather", 1e6, 8) == pytest.approx(ag["lat"] + 7 / 8 * 1e6 / ag["bw"])


def test_across_nodes_a_group_drives_as_many_nics_as_it_has_ranks_on_each_node():
    """The published all-reduce across H100 nodes had all 8 GPUs of each node in the group
    (its rings over all 8 NICs at once); a data-parallel group of a D = 8 model has one rank per
    node, so one NIC: an eighth of the curve's bandwidth; D = 4, two; a model group of 16
    fills both nodes; a pipeline's hop is one NIC at its datasheet rate."""
    from tspbench.core.mesh import Axis
    from tspbench.projection.costmodel import across, call_time, load_preset, ranks_per_node, rates

    cfg = get_config("7b")
    r = rates(load_preset("h100"), 8)

    def spec(D: int, dp: int) -> RunSpec:
        return RunSpec.make("tp", cfg, degree=D, dp=dp, seq_len=8192, dtype="bf16")

    assert ranks_per_node(spec(8, 16), Axis.DP, 16, 8) == 1
    assert ranks_per_node(spec(4, 4), Axis.DP, 4, 8) == 2
    assert ranks_per_node(spec(16, 1), Axis.MODEL, 16, 8) == 8
    tpsp = RunSpec.make("tpsp", cfg, degree=16, tp=4, sp=4, seq_len=8192, dtype="bf16")
    assert ranks_per_node(tpsp, Axis.SP, 4, 8) == 2  # (its ranks T = 4 apart)
    # its tensor groups are 4 consecutive ranks: inside a node although the model group of 16
    # is not; its context-parallel group leaves it
    from tspbench.projection.costmodel import crosses_nodes, group_link

    assert not crosses_nodes(tpsp, Axis.TP, 4, 8) and crosses_nodes(tpsp, Axis.SP, 4, 8)
    assert group_link(tpsp, r, Axis.TP, "all_reduce", 4, 8) is r["groups"]["4"]["all_reduce"]
    sp = group_link(tpsp, r, Axis.SP, "all_gather", 4, 8)["curves"]["all_gather"]
    assert sp["curve_scale"] == pytest.approx(across(r, 2)["curves"]["all_gather"]["curve_scale"])
    wide = RunSpec.make("tpsp", cfg, degree=16, tp=16, sp=1, seq_len=8192, dtype="bf16")
    assert crosses_nodes(wide, Axis.TP, 16, 8)
    n = 1 << 30
    floor = call_time(across(r, 8), "all_reduce", 8, 16)  # (a latency: NICs do not move it)
    assert call_time(across(r, 1), "all_reduce", 8, 16) == floor
    full = call_time(across(r, 8), "all_reduce", n, 16) - floor
    assert call_time(across(r, 1), "all_reduce", n, 16) - floor == pytest.approx(8 * full)
    assert call_time(across(r, 2), "all_reduce", n, 16) - floor == pytest.approx(4 * full)
    # every group-wide kind reads a curve across nodes (its own, its proxy's, else the
    # all-reduce's) on every preset that has one; a point-to-point hop none
    from tspbench.core.comm import KINDS
    from tspbench.projection.costmodel import presets

    for name in presets():
        curves = rates(load_preset(name), 8)["inter"]["curves"]
        assert set(curves) == set(KINDS) - {"send_recv"}, name
    # at 1 GiB the curve of 4 nodes reads 358 GB/s: one NIC's share is 45, the NIC 50 x 0.8
    assert 2 * 15 / 16 * n / call_time(across(r, 1), "all_reduce", n, 16) / 1e9 == pytest.approx(
        358.14 / 8, rel=0.01
    )


def test_every_published_curve_is_sourced_and_well_formed():
    """hardware.json's curves: each names its source and hardware, sizes strictly rising,
    bandwidths positive, for a kind the strategies call."""
    from tspbench.core.comm import KINDS
    from tspbench.projection.costmodel import presets

    seen = 0
    for name, p in presets().items():
        for where, kinds in p.get("collectives", {}).items():
            if where in ("sources", "proxy"):
                continue
            assert where in ("intra", "inter"), (name, where)
            for kind, sets in kinds.items():
                assert kind in KINDS, (name, kind)
                for m in sets:
                    seen += 1
                    assert m["source"] and m["hardware"] and m["gpus"] >= 2, (name, kind)
                    assert m["collective"] == kind, (name, kind)
                    sizes = [r[0] for r in m["rows"]]
                    assert sizes == sorted(set(sizes)) and len(sizes) >= 3, (name, kind)
                    # the time per call where given (busbw is printed to 0.01 GB/s: 0 at 8 B)
                    assert all((r[1] if r[2] is None else r[2]) > 0 for r in m["rows"]), name
    assert seen, "no preset has a published curve"


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
