"""Decode at paper scale (tspbench/projection/decode.py): `tspbench project --mode decode` gives
the prefill time, decode latency, bytes per token and memory for 7B at 16K-128K prompts, batch
1-64, D = 8 on the MI300X and H100 presets, from the same closed forms the tests check against
the counter."""

from __future__ import annotations

import json

import pytest

from tspbench.cli import main
from tspbench.core.config import get_config
from tspbench.core.decode import bytes_per_step
from tspbench.projection.costmodel import load_preset
from tspbench.projection.decode import memory, project_decode
from tspbench.runtime.spec import RunSpec

LAYS = {"tsp": {"degree": 8}, "tp": {"degree": 8}, "sp": {"degree": 8},
        "tpsp": {"tp": 2, "sp": 4}}  # fmt: skip


def _spec(strategy: str, P: int, B: int, model: str = "7b") -> RunSpec:
    return RunSpec.make(strategy, get_config(model), seq_len=P, batch=B, mode="decode",
                        new_tokens=64, dtype="bf16", **LAYS[strategy])  # fmt: skip


@pytest.mark.parametrize("hw", ["mi300x", "h100"])
@pytest.mark.parametrize("strategy", LAYS)
@pytest.mark.parametrize("P, B", [(16384, 1), (16384, 64), (131072, 1)])
def test_projects_decode_at_paper_scale(hw, strategy, P, B):
    c = _spec(strategy, P, B)
    res = project_decode(c, load_preset(hw))
    assert 0 < res["decode_latency_s"] < res["prefill_time_s"]
    assert res["decode_tokens_per_s"] == pytest.approx(B / res["decode_latency_s"])
    assert res["decode_bytes_per_token"] == sum(bytes_per_step(c.impl.decode_schedule(c)).values())
    assert res["kv_cache_bytes"] == c.impl.kv_cache_bytes(c) < res["peak_mem_bytes"]


def test_the_cache_decides_the_memory_at_long_context():
    """7B MHA at 128K, batch 8: each rank's cache (64 GiB for TSP, SP, TP alike) outweighs
    three times its weights, SP's whole model (16.5 GiB) included."""
    mems = {s: memory(_spec(s, 131072, 8)) for s in ("tsp", "tp", "sp")}
    assert mems["tsp"]["kv_cache_bytes"] == mems["sp"]["kv_cache_bytes"]
    for m in mems.values():
        assert m["kv_cache_bytes"] > 3 * m["weights"]
    assert mems["sp"]["weights"] == 8 * mems["tsp"]["weights"] - 7 * (2 * 32 + 1) * 4096 * 2


def test_project_cli_decode_json(capsys):
    argv = ["project", "--strategy", "tsp", "--model", "7b", "--dtype", "bf16", "--mode",
            "generate", "--prompt-len", "16384", "--new-tokens", "32", "--degree", "8",
            "--batch", "4", "--hardware", "h100", "--json"]  # fmt: skip
    assert main(argv) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["projected"] and obj["generate_time_s"] > obj["prefill_time_s"] > 0
    assert obj["decode_bytes_per_token"] > 0 and obj["fits"] in (True, False)
