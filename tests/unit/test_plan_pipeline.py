"""The planner's pipeline axis (issue 34): which pipelines it tries, what it prices them at,
and the closed forms it uses (tspbench/projection/stages.py, ``costmodel.project_pipeline``).
The stage memory is checked against measured peaks in
tests/integration/test_pipeline_parallel.py; here, the enumeration and the model's structure."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from tests.unit.test_plan import counted, plan_cli  # noqa: F401  (a fixture)
from tspbench.core.config import ConfigError, get_config
from tspbench.projection import costmodel, stages
from tspbench.projection.plan import Request, search
from tspbench.runtime.registry import strategies
from tspbench.runtime.spec import RunSpec

SEVEN_B = get_config("7b")


def _spec(strategy: str = "tsp", **kw) -> RunSpec:
    args = dict(degree=8, pp=4, seq_len=32768, batch=8, mode="train", dtype="bf16",
                recompute="full", microbatches=8)  # fmt: skip
    return RunSpec.make(strategy, SEVEN_B, **(args | kw))


def test_plans_try_every_pipeline_of_the_strategies_that_stage(counted):  # noqa: F811
    both = ("1f1b", "gpipe")
    p = search.plan(Request.make("7b", "h100", 131072, 16, pp_schedules=both), use_cache=False)
    tried: dict[str, set] = {}
    for conf in p.configs:
        tried.setdefault(conf.strategy, set()).add((conf.layout.degree, *conf.pipeline))
    staged = {n for n, s in strategies().items() if s.stages}
    assert staged >= {"tsp", "tp", "sp", "tpsp", "fsdp_cp"}
    for name, got in tried.items():
        pps = {pp for _, pp, _ in got}
        if name in staged and name != "single":
            # G / D = 16 / D stages at most, each dividing the 32 layers; both schedules
            assert {(d, pp) for d, pp, _ in got} == {
                (d, pp)
                for d in {d for d, _, _ in got}
                for pp in (1, 2, 4, 8, 16)
                if 16 % (d * pp) == 0
            }, name
            assert {s for _, pp, s in got if pp > 1} == {"1f1b", "gpipe"}
        else:
            assert pps == {1}, name
    for c in p.candidates:  # every micro-batch count divides the batch, from pp up
        if c.layout.pp > 1:
            assert c.microbatches >= c.layout.pp and c.batch % c.microbatches == 0
            assert c.layout.world_size == 16


def test_the_user_restricts_the_pipelines(capsys, counted, tmp_path):  # noqa: F811
    base = ("--model", "7b", "--hardware", "h100", "--seq-len", 65536, "--gpus", 16, "--json",
            "--cache", tmp_path)  # fmt: skip
    rc, out, _ = plan_cli(capsys, *base, "--pp", 1)
    assert rc == 0 and {c["pp"] for c in json.loads(out)["candidates"]} == {1}
    rc, out, _ = plan_cli(capsys, *base, "--pp", 2, "--pp-schedule", "gpipe")
    cands = json.loads(out)["candidates"]
    assert rc == 0 and {(c["pp"], c["pp_schedule"]) for c in cands} == {(2, "gpipe")}
    # by default 1F1B alone: GPipe's projected step is its twin's, with more in flight
    rc, out, _ = plan_cli(capsys, *base, "--pp", 2)
    assert rc == 0 and {c["pp_schedule"] for c in json.loads(out)["candidates"]} == {"1f1b"}
    # interleaved 1F1B on request: its micro-batch counts split into equal rounds (torch's rule)
    rc, out, _ = plan_cli(capsys, *base, "--pp", 2, "--pp-schedule", "interleaved1f1b")
    inter = json.loads(out)["candidates"]
    assert rc == 0 and inter and {c["pp_schedule"] for c in inter} == {"interleaved1f1b"}
    assert all(c["microbatches"] % (c["microbatches"] // 2) == 0 for c in inter)
    rc, out, _ = plan_cli(capsys, *base, "--pp", 2, "--pp-schedule", "gpipe", "1f1b")
    assert {c["pp_schedule"] for c in json.loads(out)["candidates"]} == {"gpipe", "1f1b"}
    assert {c["strategy"] for c in cands} <= {n for n, s in strategies().items() if s.stages}


def test_a_pipelined_best_plan_runs_as_printed(capsys, counted, tmp_path):  # noqa: F811
    """Whatever wins, a pipelined row's run line carries its stages, schedule and micro-batch
    count, and the spec it parses to is the row's."""
    from tests.helpers.checks import argv_spec

    rc, out, _ = plan_cli(capsys, "--model", "7b", "--hardware", "h100", "--seq-len", 131072,
                          "--gpus", 16, "--pp", 2, "--cache", tmp_path)  # fmt: skip
    assert rc == 0
    best = next(line for line in out.splitlines() if line.startswith("best plan:"))
    run = next(x.strip() for x in out.splitlines() if x.strip().startswith("tspbench run"))
    assert " x PP2 " in best and "--pp 2" in run
    argv = run.split()[2:]
    argv = argv[: argv.index("--device")]
    spec = argv_spec(argv)
    assert spec.layout.pp == 2 and f"M={spec.microbatches} " in best
    # the sweep config the plan prints makes this very cell
    from tspbench.pipeline.cells import sweep_cells

    snippet = yaml.safe_load(out.split("pipeline config (workflows/config/<name>.yaml):\n")[1])
    (cell,), _ = sweep_cells(snippet)
    assert cell.spec.replace(quiet=spec.quiet, warmup=spec.warmup, steps=spec.steps) == spec


def test_the_fullest_stage_is_among_the_three_priced():
    """stages.memory prices the first, second and last stage only; every stage's own price
    is no higher than their maximum (1F1B, GPipe and interleaved 1F1B, whose middle ranks hold
    the most sends, recomputation or not, infer)."""
    inter = {"pp_schedule": "interleaved1f1b"}
    for kw in ({}, {"pp_schedule": "gpipe"}, {"recompute": "none", "batch": 16,
               "microbatches": 16}, {"pp": 8}, {"mode": "infer", "recompute": "none"}, inter,
               inter | {"pp": 8}, inter | {"recompute": "none", "microbatches": 4}):  # fmt: skip
        c = _spec(**kw)
        _, top = stages.memory(c)
        every = [stages.stage_memory(c, s)["peak"] for s in range(c.layout.pp)]
        assert top["peak"] == max(every), kw


def test_stage_parameters_split_the_whole_model_exactly():
    for name, kw in (("tsp", {}), ("tp", {}), ("sp", {"degree": 8}), ("fsdp_cp", {}),
                     ("tpsp", {"tp": 2, "sp": 2})):  # fmt: skip
        c = _spec(name, **({"degree": 4} | kw))
        whole = c.impl.costs.param_numel(c.cfg, dataclasses.replace(c.layout, pp=1))
        assert sum(stages.stage_params(c, s) for s in range(4)) == whole, name


@pytest.mark.parametrize(("pp", "M"), [(2, 2), (2, 4), (2, 6), (4, 4), (4, 8), (4, 12)])
def test_interleaved_chunks_in_flight_are_torchs(pp, M):
    """The closed form's chunks in flight per rank under interleaved 1F1B equal the most
    forwards without their backward in torch's own order of actions for that rank (its
    ``pipeline_order``, built on the fake process group from two stages per rank); before each
    backward, the sent activations torch still holds are the closed form's (every backward
    before it sent its chunk's input gradient, but the first stage's, and left the output it
    sent alive, but the last stage's)."""
    import re

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
    try:
        x = torch.empty(1, 2, device="meta")
        own = [PipelineStage(nn.Linear(2, 2), i * pp, 2 * pp, torch.device("cpu"),
                             input_args=(x,), output_args=(x,)) for i in range(2)]  # fmt: skip
        order = ScheduleInterleaved1F1B(own, M).pipeline_order
    finally:
        dist.destroy_process_group()
    c = _spec(pp=pp, microbatches=M, batch=M, pp_schedule="interleaved1f1b")
    for rank, actions in order.items():
        live = most = done = held = 0
        for a in filter(None, actions):
            kind = re.fullmatch(r"(\d+)([FB])\d+", str(a))
            assert kind, a  # (compute actions only, before torch adds the sends)
            if kind.group(2) == "B":
                assert stages.sends_held(c, rank, done) == held, (rank, done, held)
                g = int(kind.group(1))
                held += (g != 2 * pp - 1) + (g != 0)
                done += 1
            live += 1 if kind.group(2) == "F" else -1
            most = max(most, live)
        assert stages.in_flight(c, rank) == most, (rank, most)
        assert done == 2 * M and stages.sends_held(c, rank, done) == held


def test_1f1b_keeps_fewer_micro_batches_than_gpipe():
    one, gp = _spec(recompute="none"), _spec(recompute="none", pp_schedule="gpipe")
    assert [stages.in_flight(one, s) for s in range(4)] == [4, 3, 2, 1]
    assert [stages.in_flight(gp, s) for s in range(4)] == [8] * 4
    assert stages.memory(one)[1]["peak"] < stages.memory(gp)[1]["peak"]


def test_the_pipelined_step_is_the_schedule_of_its_slowest_stage():
    """(M + pp - 1) slots of one stage's micro-batch: doubling M with the batch adds M slots,
    and the bubble is (pp - 1) / (M + pp - 1) of the schedule."""
    pre = costmodel.load_preset("h100")
    a = costmodel.project(_spec(batch=8, microbatches=8), pre, ops=0)
    b = costmodel.project(_spec(batch=16, microbatches=16), pre, ops=0)
    slot = a["pp_bubble_s"] / 3
    once = a["pp_once_s"] + a["dp_reduce_s"]  # the step's own gradient reductions, once
    assert a["device_s"] == pytest.approx(11 * slot + once)
    assert b["device_s"] == pytest.approx(19 * slot + once)
    assert a["pp_bubble_fraction"] == pytest.approx(3 / 11)
    # the host issues every micro-batch's operations
    assert costmodel.recharge(a, 1000)["ops_per_step"] == 8 * 1000
    # model FLOPs: the whole model's, shared by the stages
    whole = _spec(pp=1, microbatches=0)
    assert a["flops_per_rank"] * 4 == pytest.approx(
        costmodel.project(whole, pre, 0)["flops_per_rank"], rel=1e-6
    )


def test_a_pipeline_that_leaves_the_node_sends_over_the_nic():
    pre = costmodel.load_preset("h100")  # 8 GPUs per node
    inside = costmodel.project(_spec(degree=2, pp=4), pre, ops=0)  # 8 ranks
    across = costmodel.project(_spec(degree=8, pp=4), pre, ops=0)  # 32 ranks
    r = costmodel.rates(pre, 8)
    for p, c, link in ((inside, _spec(degree=2, pp=4), r["send_recv"]),
                       (across, _spec(degree=8, pp=4), r["inter"])):  # fmt: skip
        one_way = stages.micro_spec(c).tokens * c.cfg.hidden * c.e
        assert p["pp_hop_s"] == pytest.approx(
            2 * costmodel.call_time(link, "send_recv", one_way, 2)
        )
    # inside the node the published curve (the all-gather's: no point-to-point one), across
    # nodes one NIC at its rate (the curves across nodes are the rings' over every NIC)
    one_way = stages.micro_spec(_spec(degree=8, pp=4)).tokens * 4096 * 2
    nic = r["inter"]
    assert "send_recv" not in nic["curves"] and "curve" in r["send_recv"]
    assert across["pp_hop_s"] == pytest.approx(2 * (nic["lat"] + one_way / nic["bw"]))
    # replicas in a pipeline: their gradient sum after the last micro-batch, not hidden
    dp = costmodel.project(_spec(degree=4, pp=4, dp=2), pre, ops=0)
    assert dp["dp_reduce_s"] > 0 and inside["dp_reduce_s"] == 0


def test_tied_embeddings_cost_their_copy_and_one_all_reduce_a_step():
    """With tied embeddings the last stage holds the embedding's copy and the two ends sum
    their gradients once a step: the table's elements on a rank, over the NIC where the
    pipeline leaves the node (the first and the last stage are furthest apart)."""
    import dataclasses

    tied = dataclasses.replace(SEVEN_B, tie_embeddings=True)
    pre = costmodel.load_preset("h100")
    r = costmodel.rates(pre, 8)
    for degree, link in ((2, r["groups"]["2"]["all_reduce"]), (8, costmodel.across(r, 1))):
        c = _spec(degree=degree, pp=4).replace(cfg=tied)
        table = tied.vocab * tied.hidden // degree  # (TSP: its vocabulary rows)
        assert stages.table_params(c) == table
        untied = _spec(degree=degree, pp=4)  # (the copy where the untied head was)
        assert [stages.stage_params(c, s) for s in range(4)] == [
            stages.stage_params(untied, s) for s in range(4)
        ]
        p = costmodel.project(c, pre, ops=0)
        want = costmodel.call_time(link, "all_reduce", table * 2, 2)
        assert p["pp_tie_s"] == pytest.approx(want) and want > 0
        assert costmodel.project(_spec(degree=degree, pp=4), pre, ops=0)["pp_tie_s"] == 0
    assert costmodel.project(c.replace(mode="infer"), pre, ops=0)["pp_tie_s"] == 0


def test_sp_sums_its_gradients_once_a_step_not_once_a_micro_batch():
    """SP's all-reduce of every gradient runs after the schedule (finish_grads): doubling the
    micro-batches adds their slots, not another all-reduce, which is charged once."""
    pre = costmodel.load_preset("h100")
    sp = dict(degree=4, pp=2, seq_len=8192, recompute="none")
    a = costmodel.project(_spec("sp", batch=8, microbatches=8, **sp), pre, ops=0)
    b = costmodel.project(_spec("sp", batch=16, microbatches=16, **sp), pre, ops=0)
    slot = a["pp_bubble_s"]  # pp - 1 = 1 slot
    assert b["device_s"] - a["device_s"] == pytest.approx(8 * slot)
    c = _spec("sp", batch=8, microbatches=8, **sp)
    grads = (
        stages.micro_spec(c).impl.costs.param_numel(
            stages.micro_spec(c).cfg, stages.micro_spec(c).layout
        )
        * 2
    )
    r = costmodel.rates(pre, 8)["groups"]["4"]["all_reduce"]
    assert a["pp_once_s"] >= costmodel.call_time(r, "all_reduce", grads, 4)


def test_fsdp_cp_stages_keep_their_units_or_move_them_every_micro_batch():
    """Kept units (torch's FSDP2 stage): the gathers and reduce-scatters are charged once a
    step, so doubling the micro-batches adds only their slots; the stage holds its gathered
    weights and their full gradients (D x its shards each). Regathered per micro-batch: every
    slot carries its unit traffic, and the stage holds neither."""
    pre = costmodel.load_preset("h100")
    kw = dict(degree=8, pp=2, seq_len=8192, recompute="none")
    added, once = {}, {}
    for keep in (True, False):
        a = _spec("fsdp_cp", batch=8, microbatches=8, pp_keep_gathered=keep, **kw)
        b = _spec("fsdp_cp", batch=16, microbatches=16, pp_keep_gathered=keep, **kw)
        pa, pb = costmodel.project(a, pre, ops=0), costmodel.project(b, pre, ops=0)
        added[keep] = pb["device_s"] - pa["device_s"]
        once[keep] = pa["pp_once_s"]
        assert added[keep] == pytest.approx(8 * pa["pp_bubble_s"]), keep
        mb = stages.micro_spec(a)
        sizes = set(a.impl.costs.unit_bytes(mb))  # (the K/V gathers' differ)
        units = [ev for ev in costmodel.analytic.schedule(mb)
                 if ev[2] in ("all_gather", "reduce_scatter") and ev[4] in sizes]  # fmt: skip
        assert units and all(ev.per_step == keep for ev in units), keep
        n = stages.stage_params(a, 0)
        held = (n * 8 * 2, n * 8 * 2) if keep else (0, 0)
        assert a.impl.costs.stage_held(a, n) == held
    # each micro-batch more costs the kept stage less (no unit traffic in its slot), and its
    # once-a-step work holds the units' reduce-scatters (at least their bus time)
    assert added[True] < added[False]
    r = costmodel.rates(pre, 8)["groups"]["8"]["reduce_scatter"]
    n = stages.stage_params(_spec("fsdp_cp", **kw), 1)
    assert once[True] - once[False] >= costmodel.call_time(r, "reduce_scatter", n * 8 * 2, 8)
    kept = stages.stage_memory(_spec("fsdp_cp", **kw), 0)
    per_mb = stages.stage_memory(_spec("fsdp_cp", pp_keep_gathered=False, **kw), 0)
    assert kept["peak"] > per_mb["peak"]


def test_an_option_of_pipelines_only_is_planned_and_checked_only_in_pipelines(counted):  # noqa: F811
    """FSDP+CP's pp_keep_gathered: both values in a pipeline, left out without one (the run's
    default, and refused if set there); and never among the shared tests' flat option settings."""
    p = search.plan(Request.make("7b", "h100", 131072, 16), use_cache=False)
    values: dict[int, set] = {}
    for conf in p.configs:
        if conf.strategy == "fsdp_cp":
            values.setdefault(conf.layout.pp, set()).add(conf.options.get("pp_keep_gathered"))
    assert values[1] == {None} and values[2] == {True, False}  # (None: the default, unshown)
    assert all("pp_keep_gathered" not in o for o in strategies()["fsdp_cp"].checked_options())
    with pytest.raises(ConfigError, match=r"^pp_keep_gathered=off: only with pp > 1 \(got pp=1\)$"):
        _spec("fsdp_cp", pp=1, microbatches=0, pp_keep_gathered=False)
