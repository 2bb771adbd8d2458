"""What a cell asks Slurm for: nodes, tasks, GPUs, CPUs, memory and a runtime.

The runtime is either flat (``runtime_minutes`` at ``runtime_base_seq``, growing with S: the CPU
and small configs) or, with ``runtime_from: projection``, sized per cell from what it will do:
the measured start-up (``startup_s``: imports, rendezvous, model build; every record says how
long its own took) plus every step the run takes (the probe's three, warm-up, timed) at the cost
model's projected step time for ``hardware_preset``, times ``runtime_margin`` (the model's step
times run up to 2.3x fast against published end-to-end measurements: issue 29).
"""

from __future__ import annotations

import math
from typing import Protocol

from tspbench.projection.costmodel import load_preset, project
from tspbench.projection.decode import project_decode
from tspbench.projection.node import node_share
from tspbench.runtime.spec import DECODE_MODES, RunSpec


class Cell(Protocol):
    """What sizing needs of a :class:`tspbench.pipeline.cells.Cell` (which builds on this)."""

    @property
    def spec(self) -> RunSpec: ...

    @property
    def gpus(self) -> int: ...


# Slurm minutes per cell: the run rule doubles it on the retry and passes it on as --time-limit,
# which the CLI accepts up to a week
MAX_RUNTIME_MIN = 3 * 24 * 60
PROBE_STEPS = 3  # first-step peak, steady-state peak, FLOP count (runtime.measure.probe)
PROBE_GENERATIONS = 2  # the tracked probe and the FLOP-counted generation (runtime.decode)
STOP_MARGIN_S = 60  # the run stops itself 30 s before the limit (--time-limit), then exits


def projected_work_s(cell: Cell, preset_name: str) -> float:
    """Seconds of steps a cell runs on ``preset_name`` by the cost model (no dispatch term:
    closed forms only, so that Snakemake sizes hundreds of jobs in a moment)."""
    spec, preset = cell.spec, load_preset(preset_name)
    runs = spec.warmup + spec.steps
    if spec.mode in DECODE_MODES:
        return (PROBE_GENERATIONS + runs) * project_decode(spec, preset, 0)["generate_time_s"]
    return (PROBE_STEPS + runs) * project(spec, preset, ops=0)["step_time_s"]


def runtime_minutes(cell: Cell, config: dict) -> int:
    """A cell's Slurm runtime in minutes, at most :data:`MAX_RUNTIME_MIN` (the rule multiplies
    it by the attempt)."""
    if config.get("runtime_from", "flat") == "projection":
        work = projected_work_s(cell, config["hardware_preset"])
        need = config.get("startup_s", 180) + config.get("runtime_margin", 3.0) * work
        return min(MAX_RUNTIME_MIN, math.ceil((need + STOP_MARGIN_S) / 60))
    base = config.get("runtime_minutes", 20)
    if cell.spec.mode != "train":
        base = max(1, round(base * config.get("infer_runtime_fraction", 0.25)))
    grow = max(1, cell.spec.seq_len / config.get("runtime_base_seq", 16384))
    return min(MAX_RUNTIME_MIN, int(base * grow))


def host_resources(config: dict, ranks_here: int) -> dict:
    """CPUs per rank, memory per node (MB, None: the site's default) and exclusivity: the
    config's ``cpus_per_task``, ``mem_mb`` and ``exclusive``, or with ``node_resources:
    preset`` the cell's share of ``hardware_preset``'s node (:func:`node_share`)."""
    if config.get("node_resources", "config") == "preset":
        preset = load_preset(config["hardware_preset"])
        return node_share(preset, config["gpus_per_node"], ranks_here)
    return {
        "cpus_per_task": config.get("cpus_per_task", 1),
        "mem_mb": config.get("mem_mb"),
        "exclusive": config.get("exclusive", False),
    }


def slurm_resources(cell: Cell, config: dict) -> dict:
    """A cell's Slurm job: nodes, one task per rank (tasks_per_node), GPUs per node as gres,
    ``mpi`` (srun starts the ranks; the plugin wants it only for more than one task per node),
    CPUs per task, memory per node (``mem_mb``, the site's default when unset), ``--exclusive``
    nodes on request, and a runtime in minutes (:func:`runtime_minutes`)."""
    per_node = min(cell.gpus, config["gpus_per_node"])
    host = host_resources(config, per_node)
    return {
        "cpus_per_task": host["cpus_per_task"],
        "mem_mb": host["mem_mb"] or 0,  # 0: no --mem, the site's default
        "slurm_extra": "--exclusive" if host["exclusive"] else "",
        "nodes": math.ceil(cell.gpus / config["gpus_per_node"]),
        "tasks_per_node": per_node,
        "gres": f"gpu:{per_node}" if config.get("gpu", False) else "",
        "mpi": "srun" if per_node > 1 else "",
        "runtime": runtime_minutes(cell, config),
    }
