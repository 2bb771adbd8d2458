"""Decode at paper scale (tspbench/projection/decode.py): `tspbench project --mode decode` gives
the prefill time, decode latency, bytes per token and memory for 7B at 16K-128K prompts, batch
1-64, D = 8 on the MI300X and H100 presets, from the same closed forms the tests check against
the counter."""

from __future__ import annotations

import json

import pytest
import yaml

from tspbench.cli import main
from tspbench.core.config import get_config
from tspbench.core.decode import bytes_per_step
from tspbench.projection import costmodel
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
    assert res["decode_bytes_per_token"] == sum(bytes_per_step(c.impl.decoder.schedule(c)).values())
    assert res["kv_cache_bytes"] == c.impl.decoder.kv_cache_bytes(c) < res["peak_mem_bytes"]


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


def test_model_cli_decode_is_the_decode_model(capsys):
    """`tspbench model --mode decode` gives the decode memory (cache included) and one decode
    step's bytes, not a forward pass's."""
    argv = ["model", "--model", "7b", "--strategy", "tsp", "--degree", "8", "--mode",
            "decode", "--prompt-len", "131072", "--new-tokens", "64", "--dtype", "bf16",
            "--json"]  # fmt: skip
    assert main(argv) == 0
    obj = json.loads(capsys.readouterr().out)
    c = _spec("tsp", 131072, 1)
    assert obj["memory_bytes"] == memory(c)
    step = {k.split("/")[1]: b for k, b in obj["comm_bytes"].items() if k.startswith("decode step")}
    assert step == {k: b for k, b in bytes_per_step(c.impl.decoder.schedule(c)).items() if b}


@pytest.fixture
def plan_decode(capsys, monkeypatch, tmp_path):
    """`tspbench plan --mode decode|generate ... --json`, dispatch counts stubbed (recorded)."""
    counted = []

    def ops(key):  # the shrunk copy's one- and two-layer counts
        counted.append(key)
        return 5000, 5000

    monkeypatch.setattr(costmodel, "layer_counts", ops)

    def run(mode: str, *argv) -> dict:
        args = ["plan", "--model", "7b", "--hardware", "mi300x", "--mode", mode, "--json",
                "--cache", str(tmp_path), *map(str, argv)]  # fmt: skip
        assert main(args) == 0
        return json.loads(capsys.readouterr().out) | {"counted": counted}

    return run


def test_plan_decode_ranks_serving_layouts(plan_decode):
    """The serving question: which layout generates the most tokens/s from 8 MI300X after a
    128K prompt. Every decoding strategy is tried; model groups serve apart (a run of dp=1)."""
    obj = plan_decode("decode", "--prompt-len", 131072, "--new-tokens", 128, "--gpus", 8,
                      "--max-batch", 64)  # fmt: skip
    cands = obj["candidates"]
    assert {c["strategy"] for c in cands if c["fits"]} == {"single", "tsp", "tp", "sp", "tpsp"}
    for c in cands:
        if c["strategy"] in ("dp", "fsdp_cp"):
            assert not c["fits"] and "no decode path" in c["binding"]
        elif c["tokens_per_s"] is not None:
            assert c["degree"] * c["dp"] == 8 and c["new_tokens"] == 128
            assert c["tokens_per_s"] == pytest.approx(c["dp"] * c["batch"] / c["step_time_s"])
            assert c["step_time_s"] == c["decode_latency_s"] and c["throughput_exact"]
    best = obj["best"]
    assert best["fits"] and best["peak_mem_bytes"] <= 192 * 2**30
    assert best["tokens_per_s"] == max(c["tokens_per_s"] for c in cands if c["fits"])
    assert "--mode decode --new-tokens 128" in best["run"] and not obj["counted"]

    def largest(strategy):
        return max(c["batch"] for c in cands if c["fits"] and c["strategy"] == strategy
                   and c["degree"] == 8)  # fmt: skip

    assert largest("tsp") > largest("tp")  # its smaller memory admits a larger batch
    from tspbench.pipeline.cells import sweep_cells

    cells, filtered = sweep_cells(yaml.safe_load(obj["pipeline_config"]))
    assert len(cells) == 1 and not filtered
    spec = cells[0].spec
    assert (spec.mode, spec.new_tokens, spec.layout.world_size) == ("decode", 128, best["degree"])


def test_plan_generate_charges_the_prefill(plan_decode):
    """generate: a step is the whole generation (prefill + N-1 decode steps); the dispatch
    charged is the prefill's, counted on its forward pass."""
    obj = plan_decode("generate", "--prompt-len", 16384, "--new-tokens", 64, "--gpus", 16,
                      "--max-batch", 4)  # fmt: skip
    assert obj["counted"] and {s.mode for s in obj["counted"]} == {"infer"}
    for c in obj["ranked"]:
        assert c["tokens_per_s"] == pytest.approx(c["dp"] * c["batch"] * 64 / c["step_time_s"])
        assert c["step_time_s"] > 63 * c["decode_latency_s"]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--mode", "train", "--new-tokens", "4"], "--new-tokens=4: only --mode decode"),
        (["--mode", "decode", "--new-tokens", "1"], "--new-tokens"),
    ],
)
def test_plan_decode_bad_input_is_one_line_exit_2(capsys, argv, needle):
    try:
        rc = main(["plan", "--model", "7b", "--prompt-len", "4096", "--gpus", "8", *argv,
                   "--no-cache"])  # fmt: skip
    except SystemExit as e:  # argparse's errors
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2 and not out and needle in err and len(err.strip().splitlines()) == 1, err
