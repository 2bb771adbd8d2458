"""Pipeline stages: which parameters a stage holds, the layout of pp x dp x D ranks, and a
pipelined spec's round trip through the command line (the runs: test_pipeline_parallel.py)."""

from __future__ import annotations

import pytest

from tests.helpers.checks import argv_spec
from tspbench.core.config import ConfigError, get_config
from tspbench.core.reference import param_shapes
from tspbench.core.stage import Stage
from tspbench.runtime.layout import world_layout
from tspbench.runtime.pipelined import bubble_closed_form, stages_per_rank


def test_stages_hold_every_parameter_once():
    cfg = get_config("tiny", layers=4)
    stages = [Stage.of(cfg, 2, i) for i in range(2)]
    assert [list(s.layers) for s in stages] == [[0, 1], [2, 3]]
    names = list(param_shapes(cfg))
    held = [[n for n in names if s.holds(n)] for s in stages]
    assert sorted(held[0] + held[1]) == sorted(names)
    assert "embed" in held[0] and {"norm", "head"} <= set(held[1])
    assert all(n.startswith("layers.0.") or n.startswith("layers.1.") or n == "embed"
               for n in held[0])  # fmt: skip
    assert Stage.whole(cfg).holds("embed") and Stage.whole(cfg).holds("head")


def test_with_tied_embeddings_the_last_stage_holds_the_embeddings_copy():
    """Megatron-Core's split: the embedding on the first stage, its copy as the head on the
    last (the middle ones hold neither); a whole model's one table is no copy."""
    cfg = get_config("tiny", layers=4, tie_embeddings=True)
    stages = [Stage.of(cfg, 4, i) for i in range(4)]
    assert [s.holds("embed") for s in stages] == [True, False, False, True]
    assert [s.tied_copy for s in stages] == [False, False, False, True]
    assert not any(s.holds("head") for s in stages[:3]) and "head" not in param_shapes(cfg)
    assert Stage.whole(cfg).holds("embed") and not Stage.whole(cfg).tied_copy
    assert not Stage.of(get_config("tiny", layers=4), 2, 1).tied_copy


def test_a_model_that_cannot_be_split_is_refused():
    with pytest.raises(ConfigError, match="pp=2: must divide model.layers=3"):
        Stage.of(get_config("tiny", layers=3), 2, 0)


def test_stages_go_outermost_so_model_groups_stay_in_a_node():
    lay = world_layout("tsp", 16, 8, pp=2)
    assert lay.model_groups == [list(range(8)), list(range(8, 16))]
    assert lay.pp_groups == [[r, r + 8] for r in range(8)]
    assert lay.crossing(8) == [] and lay.pp_crossing(8)  # groups in a node, sends across
    assert not world_layout("tsp", 8, 4, pp=2).pp_crossing(8)
    # replicas inside each stage: the pp groups pair the ranks of equal position
    lay = world_layout("tsp", 32, 8, pp=2)
    assert lay.pp_groups == [[r, r + 16] for r in range(16)] and lay.pp_crossing(8)
    for world, degree, pp, strategy, needle in (
        (24, 16, 1, "tsp", "must be a multiple of the model group"),
        (24, 8, 2, "tsp", r"must be a multiple of the model group \(8\) x pp \(2\)"),
        (16, 8, 2, "fsdp2_cp", "strategy fsdp2_cp does not run as a pipeline stage"),
    ):
        with pytest.raises(ConfigError, match=needle):
            world_layout(strategy, world, degree, pp=pp)


def test_a_pipelined_spec_survives_the_command_line():
    argv = ["--strategy", "tsp", "--model", "tiny", "--seq-len", "32", "--degree", "2",
            "--batch", "4", "--pp", "2", "--pp-schedule", "gpipe",
            "--microbatches", "4"]  # fmt: skip
    spec = argv_spec(argv)
    assert spec.layout.pp == 2 and spec.layout.world_size == 4
    assert spec.mesh_dims == {"pp": 2, "dp": 1, "model": 2}
    assert spec.tag == "tsp-pp2-gpipe-m4" and spec.id.startswith("tsp-pp2-gpipe-m4.D2.g4.")
    assert argv_spec(spec.to_argv()) == spec
    head = spec.header("local", 4)
    assert (head["pp"], head["pp_schedule"], head["microbatches"]) == (2, "gpipe", 4)
    assert "pp" not in argv_spec(argv[:10]).header("local", 2)  # unpipelined: no such keys


def test_bubble_closed_form():
    assert bubble_closed_form(4, 8) == pytest.approx(3 / 11)
    assert bubble_closed_form(2, 2) == pytest.approx(1 / 3)


def _torchs_order(cls: type, pp: int, M: int, v: int) -> dict[int, list]:
    """Each rank's actions as torch's interleaved schedule ``cls`` orders them, built by its own
    methods as every rank of a real schedule builds them (no stages, no process group)."""
    sched = object.__new__(cls)
    rounds = max(1, M // pp)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = pp, v, M
    sched.number_of_rounds, sched.microbatches_per_round, sched.rank = rounds, M // rounds, 0
    return {r: sched._calculate_single_rank_operations(r) for r in range(pp)}


def _idle_shares(order: dict[int, list], stages: int, cost: dict) -> list[float]:
    """Each rank's idle share of the step when it runs its actions in torch's order, each as
    soon as the rank is free and what it needs is done (a forward: the previous stage's; an
    input or whole backward: its forward and the next stage's; a weight pass: its input pass),
    each action taking ``cost`` of its kind."""
    from torch.distributed.pipelining.schedules import _ComputationType as C

    needs = {C.FORWARD: lambda s, m: [(s - 1, C.FORWARD, m)] if s else []}
    for kind in (C.BACKWARD_INPUT, C.FULL_BACKWARD):
        needs[kind] = lambda s, m, k=kind: (
            [(s, C.FORWARD, m)] + ([(s + 1, k, m)] if s < stages - 1 else [])
        )
    needs[C.BACKWARD_WEIGHT] = lambda s, m: [(s, C.BACKWARD_INPUT, m)]
    acts = {r: [a for a in o if a is not None] for r, o in order.items()}
    done: dict = {}
    clock, at = dict.fromkeys(acts, 0.0), dict.fromkeys(acts, 0)
    moved = True
    while moved:
        moved = False
        for r, todo in acts.items():
            while at[r] < len(todo):
                a = todo[at[r]]
                kind, key = (
                    a.computation_type,
                    (a.stage_index, a.computation_type, a.microbatch_index),
                )
                deps = needs[kind](a.stage_index, a.microbatch_index)
                if any(d not in done for d in deps):
                    break
                clock[r] = done[key] = max([clock[r]] + [done[d] for d in deps]) + cost[kind]
                at[r], moved = at[r] + 1, True
    assert all(at[r] == len(todo) for r, todo in acts.items()), "torch's order deadlocked"
    span = max(clock.values())
    return [1 - sum(cost[a.computation_type] for a in todo) / span for todo in acts.values()]


@pytest.mark.parametrize("pp, M", [(2, 2), (2, 4), (4, 4), (4, 8), (4, 12), (8, 16)])
def test_interleaved_bubbles_are_torchs_orders(pp, M):
    """The records' closed forms against torch's own orders run with their dependencies:
    interleaved zero-bubble's (pp - 1) / (3 v M + pp - 1) with a chunk's forward, input and
    weight passes of equal time; interleaved 1F1B's (pp - 1) / (v M + pp - 1) with its whole
    backward twice its forward. Every rank idles that share of the step."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B as I1F1B
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble as ZB
    from torch.distributed.pipelining.schedules import _ComputationType as C

    v = stages_per_rank("interleavedzb")
    zb = {C.FORWARD: 1, C.BACKWARD_INPUT: 1, C.BACKWARD_WEIGHT: 1}
    for idle in _idle_shares(_torchs_order(ZB, pp, M, v), v * pp, zb):
        assert idle == pytest.approx(bubble_closed_form(pp, M, "interleavedzb"))
    one_f_one_b = {C.FORWARD: 1, C.FULL_BACKWARD: 2}
    for idle in _idle_shares(_torchs_order(I1F1B, pp, M, v), v * pp, one_f_one_b):
        assert idle == pytest.approx(bubble_closed_form(pp, M, "interleaved1f1b"))
    assert bubble_closed_form(pp, M, "interleavedzb") < bubble_closed_form(pp, M, "interleaved1f1b")
