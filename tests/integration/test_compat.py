"""The oldest supported torch: every strategy at D = 2 equals the reference with the collective
names that torch 2.13 added hidden, as a GPU site's torch 2.11 lacks them (the names are read
in tspbench.core.compat alone). The same checks ran in a torch 2.11 venv (docs/running.md)."""

from __future__ import annotations

import re

import pytest
import torch.distributed as dist

from tests.helpers import checks
from tests.helpers.distributed import run_world
from tests.integration.test_equivalence import CASES
from tspbench.core import compat
from tspbench.core.config import ConfigError

NEW_NAMES = ("all_gather_single", "reduce_scatter_single")  # torch >= 2.13 only
# every strategy's D = 2 cases (MHA and GQA, fp32), one world of 2 ranks
D2 = [c for c in CASES if c["D"] == 2 and c["B"] <= 2 and "dtype" not in c]


def hidden_cases(cases: list[dict]) -> dict:
    """Rank side: drop the newer names from torch.distributed, then run the cases."""
    for name in NEW_NAMES:
        if hasattr(dist, name):
            delattr(dist, name)
    return {"hidden": not any(hasattr(dist, n) for n in NEW_NAMES), **checks.run_cases(cases)}


@pytest.fixture(scope="module")
def results() -> dict:
    return run_world(2, "tests.integration.test_compat:hidden_cases", D2)[0]


def test_every_strategy_has_a_d2_case():
    from tspbench.runtime.registry import strategies

    multi = {n for n, s in strategies().items() if not s.reference}
    assert multi <= {c["strategy"] for c in D2}


def test_the_newer_names_were_hidden(results):
    assert results["hidden"]


@pytest.mark.parametrize("case", D2, ids=[c["id"] for c in D2])
def test_equals_reference_without_the_newer_names(results, case):
    res = results[case["id"]]
    assert res["ok"], f"failed: {res.get('failed')}; errors {res['errors']}"


@pytest.mark.parametrize("version", ["2.6.0a0+ecf3bae", "2.10.1+cu128", "1.13.1"])
def test_a_torch_below_the_floor_is_refused_in_one_line(version):
    with pytest.raises(
        ConfigError, match=re.escape(f"torch {version}: tspbench needs torch >= 2.11")
    ):
        compat.require_torch(version)


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.11.0a0+gitabc", "2.13.0+cpu", "3.0.0"])
def test_the_floor_and_later_are_accepted(version):
    compat.require_torch(version)


@pytest.mark.parametrize(
    "cmd", [["run", "--strategy", "tsp", "--degree", "2", "--seq-len", "64"], ["doctor"]]
)
def test_run_and_doctor_refuse_an_old_torch(monkeypatch, capsys, tmp_path, cmd):
    import torch

    from tspbench.cli import main

    monkeypatch.setattr(torch, "__version__", "2.10.0+cu128")
    out = ["--out", str(tmp_path / "r.json")] if cmd[0] == "run" else []
    assert main([*cmd, *out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["tspbench: error: torch 2.10.0+cu128: tspbench needs torch >= 2.11 (the "
                   "oldest release its strategies were checked on); install a newer "
                   "CUDA/ROCm/CPU build"]  # fmt: skip
    assert not (tmp_path / "r.json").exists()
