"""Every strategy that runs models with experts equals the single-device reference on them:
loss (the load-balancing loss included), hidden states, every gradient and the weights after
three AdamW steps (tests/helpers/checks.py's check), at each of its checked groups, for
Mixtral's routing (renormalised top-k), Qwen3-MoE's (QK norms, GQA, narrower experts, top-k
not renormalised) and Qwen2-MoE's (a gated shared expert, QKV biases), with recomputation and
each of its expert-only option settings (TSP: the experts met by all-to-all, ring or
broadcast). One 4-rank gloo world runs every case; nothing here names a strategy.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.helpers.distributed import run_world
from tests.helpers.records import written_keys
from tests.helpers.runner import tspbench
from tspbench.core.config import ConfigError, get_config
from tspbench.runtime.registry import schema, strategies

MIXTRAL = {"experts": 4, "top_k": 2, "aux_loss": 0.02}
QWEN3 = {"experts": 8, "top_k": 2, "expert_ffn": 48, "norm_topk": False, "qk_norm": True,
         "kv_heads": 4, "aux_loss": 0.01}  # fmt: skip
QWEN2 = {"experts": 4, "top_k": 1, "expert_ffn": 48, "shared_ffn": 64, "qkv_bias": True,
         "norm_topk": False}  # fmt: skip
MODELS = {"mixtral": MIXTRAL, "qwen3": QWEN3, "qwen2": QWEN2}
BF16 = {"mixtral-all": {**MIXTRAL, "top_k": 4}}


def _accepts(impl, layout, model: dict, opts: dict) -> bool:
    try:
        impl.validate(
            get_config("tiny", **model), layout, 32, impl.replica_batch(layout, 2), **opts
        )
    except ConfigError:
        return False
    return True


def _strategy_cases(name: str, impl) -> list[dict]:
    """One strategy's cases: each model at each checked group, each expert-only setting at
    each group of D > 1, recomputation (with each setting) and bf16 at the largest."""
    layouts = impl.checked_layouts()
    expert_opts = [
        {o.name: v} for o in impl.options if o.experts_only for v in o.values() if v != o.default
    ]

    def case(cid: str, lay, model: str, **kw) -> dict:
        return {"id": f"{name}-D{lay.degree}-{model}{cid}", "strategy": name, "S": 32,
                "B": impl.replica_batch(lay, 2), "D": lay.degree,
                "model": {**MODELS, **BF16}[model], **kw}  # fmt: skip

    cases = []
    for lay in layouts:
        cases += [case("", lay, m) for m in MODELS if _accepts(impl, lay, MODELS[m], {})]
        for opts in expert_opts:
            if lay.degree > 1 and _accepts(impl, lay, MIXTRAL, opts):
                cases.append(case("-" + "-".join(map(str, opts.values())), lay, "mixtral", **opts))
    top = layouts[-1]
    for opts in [{}, *expert_opts]:
        tag = "".join(f"-{v}" for v in opts.values())
        cases.append(case(f"-recompute{tag}", top, "qwen3", recompute="full", **opts))
    # its dense option settings on the shared expert's model (the shared expert is a dense
    # MLP of the strategy's), and each expert-only setting under each of its own mixes
    for opts in impl.checked_options():
        tag = "-" + "-".join(f"{k}={v}" for k, v in opts.items())
        if _accepts(impl, top, QWEN2, opts):
            cases.append(case(tag, top, "qwen2", **opts))
        if len(opts) > 1:
            for extra in (e for e in expert_opts if _accepts(impl, top, MIXTRAL, {**opts, **e})):
                etag = "".join(f"-{v}" for v in extra.values())
                cases.append(case(tag + etag, top, "mixtral", **opts, **extra))
    # two replicas of a 2-rank group: the load-balancing loss's counts over both
    two = next((lay for lay in layouts if lay.degree == 2), None)
    if two is not None:
        cases.append(case("-dp2", two, "qwen3", dp=2))
    # bf16 against the fp32 reference: a token whose top-k is a near tie (a random router's
    # are nearly uniform) would pick another expert in bf16, a discrete change no tolerance
    # covers; with k = E every token meets every expert, so the two differ by rounding only
    cases.append(case("-bf16", top, "mixtral-all", S=16, dtype="bf16"))
    return cases


def _cases() -> list[dict]:
    return [
        c
        for name, impl in strategies().items()
        if impl.experts and not impl.reference
        for c in _strategy_cases(name, impl)
    ]


CASES = _cases()


@pytest.fixture(scope="module")
def results() -> dict:
    return run_world(4, "tests.helpers.checks:run_cases", CASES)[0]


def test_every_expert_strategy_and_setting_is_checked():
    """Each strategy with experts has cases at every checked degree above 1 and with each of
    its expert-only settings."""
    for name, impl in strategies().items():
        if not impl.experts or impl.reference:
            continue
        mine = [c for c in CASES if c["strategy"] == name]
        for lay in impl.checked_layouts():  # every family at every degree
            assert {c["model"]["experts"] for c in mine if c["D"] == lay.degree} >= {
                m["experts"] for m in MODELS.values()
            }, (name, lay)
        for o in (o for o in impl.options if o.experts_only):
            assert {c.get(o.name, o.default) for c in mine} == set(o.values()), o.name


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_equals_reference_with_experts(results, case):
    res = results[case["id"]]
    assert res["ok"], f"failed: {res.get('failed')}; errors {res['errors']}"


# -- through the CLI: a Mixtral config.json, read by every rank ------------------------------------
MIXTRAL_TINY = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 256,
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 4, "intermediate_size": 96, "num_local_experts": 4,
    "num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.02,
    "rms_norm_eps": 1e-5, "sliding_window": None,
}  # fmt: skip
BASE = ["--seq-len", "32", "--batch", "4", "--warmup", "0", "--steps", "1", "--quiet"]
CLI_RUNS = {  # name: (arguments, ranks)
    "single": (["--strategy", "single"], 1),
    "dp": (["--strategy", "dp", "--degree", "2"], 2),
    "tsp": (["--strategy", "tsp", "--degree", "2"], 2),
    "tsp-ring": (["--strategy", "tsp", "--degree", "2", "--moe-schedule", "ring"], 2),
    "tsp-broadcast": (["--strategy", "tsp", "--degree", "2", "--moe-schedule", "broadcast"], 2),
    "tsp-D4": (["--strategy", "tsp", "--degree", "4"], 4),
    "tp": (["--strategy", "tp", "--degree", "2"], 2),
    "fsdp_cp": (["--strategy", "fsdp_cp", "--degree", "2"], 2),
}


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "mixtral-tiny.json"
    path.write_text(json.dumps(MIXTRAL_TINY))
    return path


@pytest.fixture(scope="module")
def cli_records(tmp_path_factory, mixtral) -> dict[str, dict]:
    d = tmp_path_factory.mktemp("runs")
    out = {}
    for name, (args, world) in CLI_RUNS.items():
        rec = d / f"{name}.json"
        p = tspbench("run", "--model", str(mixtral), *BASE, *args, "--launch", "local",
                     "--nproc", str(world), "--out", str(rec))  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        out[name] = json.loads(rec.read_text())
    return out


@pytest.mark.parametrize("name", list(CLI_RUNS))
def test_cli_runs_with_experts_equal_single(cli_records, name):
    """Loss (the load-balancing loss included: the file turns it on) and gradient norm as
    single's, the record's keys with the experts' two, the same tokens per expert (the same
    routing: every token's k experts, over the global batch and both layers)."""
    ref, rec = cli_records["single"], cli_records[name]
    jsonschema.validate(rec, schema("record.schema.json"))
    assert list(rec) == written_keys("train", experts=True)
    mc = rec["model_config"]
    assert (mc["experts"], mc["top_k"], mc["aux_loss"]) == (4, 2, 0.02)
    assert rec["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert rec["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert rec["tokens_per_expert"] == ref["tokens_per_expert"]
    assert sum(rec["tokens_per_expert"]) == 4 * 32 * 2 * 2  # tokens x layers x k
    assert rec["expert_load_imbalance"] == max(rec["tokens_per_expert"]) / (4 * 32 * 2 * 2 / 4)


def test_the_schedules_move_what_they_say(cli_records):
    """all_to_all moves token rows (an all-to-all), ring and broadcast move expert weights
    (point-to-point or broadcasts and reduces), never an all-to-all of rows."""
    a2a, ring, bcast = (cli_records[n]["comm_bytes"] for n in ("tsp", "tsp-ring", "tsp-broadcast"))
    counts = 4 * 8  # the per-expert count exchange, int64 [D, E/D], once per layer and pass
    assert a2a["all_to_all"] > 100 * counts
    assert ring.get("all_to_all", 0) == bcast.get("all_to_all", 0) == 0
    assert ring["send_recv"] > a2a.get("send_recv", 0)
    assert bcast["reduce"] > a2a.get("reduce", 0)


def test_fsdp_cp_dispatches_the_rows_tsp_does(cli_records):
    """FSDP+CP's experts and TSP's all_to_all schedule split the tokens (zigzag) and the
    experts alike over the same ranks: their dispatch and combine move the same rows, to the
    byte; FSDP+CP's weights move besides (its unit gathers, reduce-scatters)."""
    tsp, fsdp = (cli_records[n]["comm_bytes"] for n in ("tsp", "fsdp_cp"))
    assert fsdp["all_to_all"] == tsp["all_to_all"]
    assert fsdp["all_gather"] > tsp["all_gather"] and fsdp["reduce_scatter"] > 0


# -- the closed forms: bytes and parameters per rank equal the counters ------------------------
EVEN = {  # k = E: every token meets every expert, so the rows that leave a rank are exact
    "mixtral": {"experts": 4, "top_k": 4, "aux_loss": 0.01},
    "qwen2": {**QWEN2, "top_k": 4},
    "qwen3": {**QWEN3, "experts": 4, "top_k": 4},
}
CLOSED_FORM_RUNS = [  # (strategy, model, D, replicas, recompute, options)
    ("tsp", "mixtral", 2, 1, "full", {}),
    ("tsp", "qwen2", 4, 1, "none", {"moe_schedule": "ring"}),
    ("tsp", "qwen3", 2, 2, "none", {"moe_schedule": "broadcast"}),
    ("tp", "qwen2", 4, 1, "full", {}),
    ("tp", "mixtral", 2, 2, "none", {}),
    ("fsdp_cp", "qwen3", 4, 1, "none", {"cp_comm": "ring"}),
    ("fsdp_cp", "qwen2", 2, 1, "full", {}),
    ("dp", "mixtral", 2, 1, "none", {}),
]


def _spec(strategy: str, model: dict, D: int, rc: str, opts: dict, dp: int = 1):
    from tspbench.runtime.spec import RunSpec

    cfg = get_config("tiny", **model)
    B = 4 // dp if strategy != "dp" else 4
    return RunSpec.make(strategy, cfg, degree=D, dp=dp, seq_len=32, batch=B, recompute=rc, **opts)


@pytest.fixture(scope="module")
def even_records(tmp_path_factory) -> list[tuple[tuple, dict]]:
    d, out = tmp_path_factory.mktemp("even"), []
    for i, (strategy, model, D, dp, rc, opts) in enumerate(CLOSED_FORM_RUNS):
        spec = _spec(strategy, EVEN[model], D, rc, opts, dp)
        rec = d / f"{i}.json"
        p = tspbench("run", *spec.to_argv(), "--launch", "local", "--nproc", str(D * dp),
                     "--out", str(rec))  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        out.append((spec, json.loads(rec.read_text())))
    return out


def test_closed_forms_equal_the_counters_with_experts(even_records):
    """Each strategy with experts, each expert schedule, the shared expert, recomputation, two
    replicas (the loss's counts over both): the analytic bytes per collective kind, the
    parameters per rank and the FLOPs (the model's, and those executed: a recomputed MoE block
    runs every GEMM again) are the counted ones, exactly (k = E: the rows each rank's experts
    get are the even routing the closed forms assume)."""
    from tspbench.projection import analytic

    for spec, rec in even_records:
        want = {k: v for k, v in analytic.comm_by_kind(spec).items() if v}
        assert {k: v for k, v in rec["comm_bytes"].items() if v} == want, spec.id
        world = spec.layout.world_size
        assert rec["param_numel_per_rank"] == [analytic.param_numel(spec)] * world, spec.id
        assert rec["flops_per_step"] == world * analytic.flops(spec), spec.id  # every rank's
        assert rec["flops_executed_per_step"] == world * analytic.flops(spec, model=False)


def test_the_estimate_routes_evenly_and_equals_the_measured_peaks(even_records):
    """The fake-tensor estimator (no data to route by: tspbench/core/moe.py's even routing)
    gives each rank of the first replica the peaks that rank measured, to the byte, first
    step and steady state, where routing is even (k = E); its bytes equal the counters'."""
    from tspbench.projection.estimate import estimate_rank

    for spec, rec in even_records:
        for r in range(spec.layout.degree):
            f = estimate_rank(spec, r, "cpu_flash")
            got = (f["peak_first_bytes"], f["peak_bytes"])
            want = (rec["peak_mem_bytes_first_step_per_rank"][r], rec["peak_mem_bytes_per_rank"][r])
            assert got == want, (spec.id, r)
            assert {k: v for k, v in f["comm_by_kind"].items() if v} == {
                k: v for k, v in rec["comm_bytes"].items() if v
            }, spec.id


def test_closed_forms_price_uneven_routing_but_the_all_to_all(cli_records):
    """With k < E the routing decides how many rows leave a rank: every other kind is still
    exact, and the all-to-all is the even routing's within the measured imbalance."""
    from tspbench.projection import analytic

    for name in ("tsp", "tsp-ring", "tsp-broadcast", "tp", "fsdp_cp"):
        args, D = CLI_RUNS[name]
        rec = cli_records[name]
        opts = {"moe_schedule": args[-1]} if "--moe-schedule" in args else {}
        model = {"experts": 4, "top_k": 2, "aux_loss": 0.02, "kv_heads": 4, "ffn": 96}
        want = analytic.comm_by_kind(_spec(rec["strategy"], model, D, "none", opts))
        got = rec["comm_bytes"]
        for kind in set(got) | set(want):
            if kind != "all_to_all":
                assert got.get(kind, 0) == want.get(kind, 0), (name, kind)
        if want.get("all_to_all"):
            ratio = got["all_to_all"] / want["all_to_all"]
            assert 1 / rec["expert_load_imbalance"] < ratio < rec["expert_load_imbalance"], name


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "num_local_experts=6", "--strategy", "tsp"], "unknown model field"),  # (ours)
        (["--set", "experts=6", "--strategy", "tsp", "--degree", "4"],
         "model.experts=6: must be divisible by D (degree)=4"),
        (["--set", "top_k=5", "--strategy", "tsp", "--degree", "2"],
         "model.top_k=5: must be between 1 and model.experts=4"),
        (["--set", "capacity_factor=1.25", "--strategy", "tsp", "--degree", "2"],
         "capacity_factor=1.25: the MoE here is dropless"),
        (["--strategy", "sp", "--degree", "2"], "model.experts=4: strategy sp runs dense models"),
        (["--strategy", "tsp", "--degree", "2", "--pp", "2"],
         "model.aux_loss=0.02 with pp=2: the load-balancing loss is the whole batch's"),
    ],
)  # fmt: skip
def test_bad_input_with_experts_exits_2(mixtral, tmp_path, args, message):
    out = tmp_path / "r.json"
    p = tspbench("run", "--model", str(mixtral), *BASE, *args, "--launch", "local",
                 "--nproc", "4", "--out", str(out))  # fmt: skip
    assert p.returncode == 2 and not out.exists()
    line = p.stderr.strip().splitlines()[-1]
    assert message in line, line


def test_an_expert_option_on_a_dense_model_exits_2(tmp_path):
    out = tmp_path / "r.json"
    p = tspbench("run", "--model", "tiny", *BASE, "--strategy", "tsp", "--degree", "2",
                 "--moe-schedule", "ring", "--launch", "local", "--nproc", "2",
                 "--out", str(out))  # fmt: skip
    assert p.returncode == 2 and not out.exists()
    assert "moe_schedule=ring: only for a model with experts" in p.stderr
