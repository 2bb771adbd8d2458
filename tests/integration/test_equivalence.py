"""Every registered strategy equals the single-device reference: loss, hidden states, all
gradients, and the weights after three AdamW steps (fp32: rtol 1e-4; bf16: see
checks.BF16_TOL), at the layouts it gives (``checked_layouts``: D in {1, 2, 4}; tpsp's
(T, Sigma) in {(2,1), (1,2), (2,2)}), MHA and GQA, batch 1 and 2, with recomputation, in bf16,
and at each option setting it gives (``checked_options``: e.g. TSP's MLP schedules, its
attention backward, KV buckets, overlap off; FSDP+CP's overlap off).

One 4-rank gloo world runs every case (side-by-side model groups when D < 4).
"""

from __future__ import annotations

import pytest

from tests.helpers.configs import LLAMA3_ROPE_TINY, YARN_ROPE_TINY
from tests.helpers.distributed import run_world
from tspbench.core.config import ConfigError, get_config
from tspbench.runtime.registry import strategies

# GQA with Llama 3.1's RoPE scaling and Qwen3's QK norms and wide heads (the scaling lives in
# the shared tables; the norms in each strategy's attention and gradient handling; head_dim 16
# makes Q and W_o's input 128 wide where h is 64, as Qwen3 0.6B/4B/32B's are twice h)
GQA = {"kv_heads": 4, "rope_scaling": LLAMA3_ROPE_TINY, "qk_norm": True, "head_dim": 16}
MODELS = {"mha": {}, "gqa": GQA}


def _layout(impl, lay) -> dict:
    """A case's layout keys (``tp``/``sp`` where the strategy factors its group)."""
    return {"D": lay.degree, **{k: v for k, v in impl.factors(lay).items() if v is not None}}


def _name(case: dict) -> str:
    return "x".join(str(case[k]) for k in ("tp", "sp") if k in case) or str(case["D"])


def _options_id(opts: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in opts.items())


def _takes(impl, layout, opts: dict, model: dict) -> bool:
    """Whether the strategy takes ``opts`` at ``layout`` (a2a+p2p needs an inner group below
    the context-parallel degree: none over 2 ranks), and they change the run there (a K/V
    exchange over one rank is none: tests/unit/test_context_parallel.py);
    test_every_option_setting_is_checked makes sure each setting runs somewhere."""
    if "cp_comm" in opts and impl.context_parallel(layout) == 1:
        return False
    try:
        impl.validate(get_config("tiny", **model), layout, 32, 2, **opts)
    except ConfigError:
        return False
    return True


def _strategy_cases(strat: str, impl) -> list[dict]:
    """One strategy's cases, at the layouts and option settings it gives."""
    layouts = impl.checked_layouts()
    lays, largest = [_layout(impl, lay) for lay in layouts], layouts[-1]
    top, gqa = lays[-1], MODELS["gqa"]

    def case(cid: str, lay: dict, layout=largest, b: int = 2, **kw) -> dict:
        B = impl.replica_batch(layout, b)  # e.g. dp gives each rank whole sequences
        return {"id": f"{strat}-{cid}", "strategy": strat, "S": 32, "B": B, **lay, **kw}

    cases = [
        case(f"D{_name(lay)}-{model}-B{impl.replica_batch(layout, b)}", lay, layout, b, model=over)
        for lay, layout in zip(lays, layouts)
        for model, over in MODELS.items()
        for b in (1, 2)
    ]
    # Qwen2's QKV biases (their gradients, TSP's padded bias rows, here more than one row of
    # width h: heads twice h/heads wide) and YaRN's scaling (Qwen2.5's), at the largest group
    qwen2 = {"qkv_bias": True, "head_dim": 16, "rope_scaling": YARN_ROPE_TINY}
    cases.append(case(f"D{_name(top)}-qwen2", top, model=qwen2))
    # Llama's attention_bias and mlp_bias: the output biases whole on every rank, added once
    biased = {"qkv_bias": True, "o_bias": True, "mlp_bias": True, "kv_heads": 4}
    cases.append(case(f"D{_name(top)}-biases", top, model=biased))
    # tied embeddings (Llama 3.2 1B): the head's and the embedding's gradients in one weight
    cases.append(case(f"D{_name(top)}-tied", top, model={"tie_embeddings": True, "kv_heads": 4}))
    if impl.context_parallel(largest) > 1:  # a length that is not a power of two (2D | 24)
        cases.append(case(f"D{top['D']}-S24", top, S=24))
    if not impl.reference:  # bf16: loose tolerances, small shapes (CPU bf16 is slow)
        cases.append(case(f"D{_name(top)}-gqa-bf16", top, S=16, model=gqa, dtype="bf16"))
    cases.append(case("recompute", top, recompute="full", model=gqa))
    for opts in impl.checked_options():  # beside the defaults, at every group of D > 1
        oid = _options_id(opts)
        for lay, layout in zip(lays, layouts):
            for model, over in MODELS.items():
                if lay["D"] > 1 and _takes(impl, layout, opts, over):
                    cases.append(case(f"D{_name(lay)}-{model}-{oid}", lay, layout, model=over,
                                      **opts))  # fmt: skip
        if _takes(impl, largest, opts, gqa):
            cases.append(case(f"D{_name(top)}-recompute-{oid}", top, recompute="full",
                              model=gqa, **opts))  # fmt: skip
        elif impl.context_parallel(largest) < 4:  # e.g. a2a+p2p, which the checked groups
            # refuse (TP+SP's Sigma <= 2): the 4-rank group that splits the sequence 4 ways
            wide = next(x for x in impl.sweep_layouts([4], [[1, 4]]) if _takes(impl, x, opts, {}))
            for model, over in MODELS.items():
                cases.append(case(f"D{_name(_layout(impl, wide))}-{model}-{oid}",
                                  _layout(impl, wide), wide, model=over, **opts))  # fmt: skip
    return cases


def _cases() -> list[dict]:
    """Every registered strategy's cases (``checked_layouts``, ``checked_options``): nothing
    here names a strategy."""
    return [c for strat, impl in strategies().items() for c in _strategy_cases(strat, impl)]


CASES = _cases()


@pytest.fixture(scope="module")
def results() -> dict:
    return run_world(4, "tests.helpers.checks:run_cases", CASES)[0]


def test_every_option_setting_is_checked():
    """Each strategy's checked option settings run in at least one case (a layout refuses
    some: none is dropped everywhere)."""
    for strat, impl in strategies().items():
        for opts in impl.checked_options():
            assert any(
                c["strategy"] == strat and all(c.get(k) == v for k, v in opts.items())
                for c in CASES
            ), (strat, opts)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_equals_reference(results, case):
    res = results[case["id"]]
    assert res["ok"], f"failed: {res.get('failed')}; errors {res['errors']}"


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c["B"] <= 2 and "dtype" not in c and "recompute" not in c],
    ids=lambda c: c["id"],
)
def test_parameter_elements_follow_the_layout(results, case):
    """The parameter elements one rank holds are the strategy's closed form (exactly), and at
    least 1/D of the model."""
    from tspbench.core.config import get_config
    from tspbench.core.layout import Layout

    res = results[case["id"]]
    full, numel = res["ref_numel"], res["numel"]
    cfg = get_config("tiny", **case.get("model", {}))
    impl = strategies()[case["strategy"]]
    lay = impl.make_layout(case["D"], case.get("tp", 1), case.get("sp", 1), 1)
    assert isinstance(lay, Layout)
    assert numel == impl.costs.param_numel(cfg, lay)
    # the D ranks together hold the whole model at least once, and none more than all of it
    # (and its padding: at most an element per rank of each of the layers + 2 units)
    assert full <= numel * lay.degree and numel <= full + cfg.layers + 2
    # AdamW state: two moments per local element (fp32 params: no master copy)
    assert res["opt_numel"] == 2 * numel
