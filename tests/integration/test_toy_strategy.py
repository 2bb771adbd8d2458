"""Adding a strategy is its folder and one registry entry: a toy strategy registered from
outside (tests/toy_strategy, through ``TSPBENCH_STRATEGIES``) runs through the command line, its
record passes the record schema, and the shared equivalence cases pass on it; a strategy that
leaves out a part of the interface is refused when its class is defined."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.helpers.distributed import run_world
from tests.helpers.runner import tspbench
from tspbench.core import costs
from tspbench.runtime import registry

TOY = "tests.toy_strategy:Toy"


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setenv(registry.PLUGINS, TOY)  # spawned ranks and subprocesses inherit it
    yield registry.strategies()["toy"]


def test_the_cli_runs_it_and_its_record_passes_the_schema(toy, tmp_path):
    out = tmp_path / "toy.json"
    args = ["--model", "tiny", "--seq-len", "32", "--warmup", "0", "--steps", "1", "--quiet"]
    p = tspbench("run", "--strategy", "toy", "--degree", "2", "--batch", "2", *args,
                 "--launch", "local", "--nproc", "2", "--out", str(out))  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads(out.read_text())
    jsonschema.validate(rec, registry.schema("record.schema.json"))
    assert rec["strategy"] == "toy" and rec["status"] == "ok" and rec["world_size"] == 2
    assert rec["comm_bytes_total"] == 0  # its schedule: nothing moves, and the counter agrees
    ref = tmp_path / "single.json"
    p = tspbench("run", "--strategy", "single", "--batch", "2", *args, "--launch", "local",
                 "--nproc", "1", "--out", str(ref))  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert rec["loss"] == pytest.approx(json.loads(ref.read_text())["loss"], rel=1e-6)


def test_the_shared_equivalence_cases_pass_on_it(toy):
    from tests.integration.test_equivalence import _strategy_cases

    cases = [c for c in _strategy_cases("toy", toy) if c["D"] <= 2 and "dtype" not in c]
    results = run_world(2, "tests.helpers.checks:run_cases", cases)[0]
    assert {c["id"] for c in cases} == set(results)
    for cid, res in results.items():
        assert res["ok"], f"{cid}: {res.get('failed')}; errors {res.get('errors')}"


def test_an_unknown_entry_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv(registry.PLUGINS, "tests.toy_strategy:Nope")
    with pytest.raises(registry.ConfigError, match="TSPBENCH_STRATEGIES='tests.toy_strategy:Nope'"):
        registry.strategies()


def test_a_strategy_missing_a_part_is_refused_when_defined():
    from tests.toy_strategy import Toy
    from tspbench.core.strategy import Strategy

    body = {k: v for k, v in vars(Toy).items() if not k.startswith("__")}
    for part in ("costs", "decoder", "display"):
        with pytest.raises(TypeError, match=f"lacks {part}"):
            type("Partial", (Strategy,), {k: v for k, v in body.items() if k != part})
    with pytest.raises(TypeError, match="costs must be"):
        type("BadCosts", (Strategy,), {**body, "costs": object()})
    with pytest.raises(TypeError, match="Can't instantiate abstract class"):
        type("NoSchedule", (costs.Costs,), {"tensor_degree": lambda s, lay: 1})()


def test_every_registered_strategy_has_every_part():
    for name, impl in registry.strategies().items():
        assert impl.name == name and impl.display
        assert isinstance(impl.costs, costs.Costs)
        assert not getattr(type(impl.costs), "__abstractmethods__", None)
        assert impl.decoder is None or not impl.decoder.__abstractmethods__
        assert impl.checked_layouts(), name
