"""A cell's Slurm runtime: flat, or its start-up plus its projected steps with a margin."""

import math

import pytest
import yaml

from tests.helpers.runner import ROOT
from tspbench.core.config import ConfigError
from tspbench.pipeline.cells import sweep_cells
from tspbench.pipeline.resources import STOP_MARGIN_S, runtime_minutes, slurm_resources
from tspbench.projection.costmodel import load_preset, project
from tspbench.projection.node import node_share

GPU_NODE = yaml.safe_load((ROOT / "workflows/config/gpu-node.yaml").read_text())


def cells_of(config):
    return {c.id: c for c in sweep_cells(config)[0]}


def test_projected_runtime_is_startup_plus_every_step_at_the_projected_time():
    cfg = {**GPU_NODE, "startup_s": 100, "runtime_margin": 1}
    cells = cells_of(cfg)
    cell = cells["tsp.D8.g8.S131072.B1.train"]
    step = project(cell.spec, load_preset("mi300x"), ops=0)["step_time_s"]
    steps = 3 + cfg["warmup"] + cfg["steps"]  # the probe's three, warm-up, timed
    assert runtime_minutes(cell, cfg) == math.ceil((100 + steps * step + STOP_MARGIN_S) / 60)
    wider = runtime_minutes(cell, {**cfg, "runtime_margin": 10})
    assert wider == math.ceil((100 + 10 * steps * step + STOP_MARGIN_S) / 60)
    assert wider > runtime_minutes(cell, cfg)


def test_every_gpu_node_cell_covers_its_startup_and_grows_with_the_sequence():
    for cell in cells_of(GPU_NODE).values():
        minutes = slurm_resources(cell, GPU_NODE)["runtime"]
        assert minutes * 60 >= GPU_NODE["startup_s"] + STOP_MARGIN_S
    by_s = {c.spec.seq_len: runtime_minutes(c, GPU_NODE) for c in cells_of(GPU_NODE).values()}
    assert by_s[131072] > by_s[16384]


def test_flat_runtime_is_unchanged():
    cfg = {k: v for k, v in GPU_NODE.items() if k not in ("runtime_from", "startup_s")}
    cfg |= {"runtime_minutes": 10, "runtime_base_seq": 16384}
    cells = cells_of(cfg)
    assert runtime_minutes(cells["tsp.D8.g8.S16384.B1.train"], cfg) == 10
    assert runtime_minutes(cells["tsp.D8.g8.S131072.B1.train"], cfg) == 80


def test_projection_without_a_preset_is_refused_naming_it():
    cfg = {k: v for k, v in GPU_NODE.items() if k != "hardware_preset"}
    with pytest.raises(ConfigError, match="hardware_preset"):
        sweep_cells(cfg)


def test_a_gpu_node_cell_asks_for_its_share_of_the_node():
    """Issue 36: every GPU cell asked for one CPU per rank, no memory and no exclusivity; with
    node_resources: preset it asks for the MI300X node's 96 vCPUs / 8 GPUs per rank, 90% of its
    1850 GiB and the whole node (a cell of 8 GPUs fills it)."""
    cell = cells_of(GPU_NODE)["tsp.D8.g8.S131072.B1.train"]
    res = slurm_resources(cell, GPU_NODE)
    assert res["cpus_per_task"] == 12 and res["slurm_extra"] == "--exclusive"
    assert res["mem_mb"] == math.floor(1850 * 2**30 * 0.9 / 2**20)
    # a job on 2 of a node's 8 GPUs: a quarter of the memory, the node shared
    share = node_share(load_preset("h100"), 8, 2)
    assert share == {"cpus_per_task": 14, "mem_mb": math.floor(2e12 * 0.9 / 4 / 2**20),
                     "exclusive": False}  # fmt: skip
    # the config's own values when node_resources is config (the default)
    own = {**GPU_NODE, "node_resources": "config", "cpus_per_task": 3, "mem_mb": 1000}
    res = slurm_resources(cell, own)
    assert (res["cpus_per_task"], res["mem_mb"], res["slurm_extra"]) == (3, 1000, "")


def test_node_resources_preset_needs_a_hardware_preset():
    cfg = {k: v for k, v in GPU_NODE.items() if k not in ("hardware_preset", "runtime_from")}
    with pytest.raises(ConfigError, match="hardware_preset"):
        sweep_cells({**cfg, "node_resources": "preset"})


def test_the_planners_srun_line_asks_for_the_same_share():
    """The plan's srun line (what ``tspbench plan`` prints under its table) asks for the
    rank's share of the preset's node; rendered from one plan row (a search of its own, cold,
    takes half a minute here and is tested in tests/unit/test_plan.py)."""
    from tspbench.core.config import get_config
    from tspbench.projection.plan.launch import run_lines
    from tspbench.projection.plan.types import Request
    from tspbench.runtime.spec import RunSpec

    req = Request.make("7b", "h100", 16384, 16)
    spec = RunSpec.make("tsp", get_config("7b"), degree=8, dp=2, seq_len=16384, batch=1)
    srun = run_lines(req, spec)["srun"]
    assert "--nodes=2" in srun and "--ntasks-per-node=8" in srun
    assert "--cpus-per-task=14" in srun and "--exclusive" in srun
    assert f"--mem={math.floor(2e12 * 0.9 / 2**20)}M" in srun
