"""A sweep config becomes cells: one (strategy, layout, S, batch, mode) run each.

Every combination a sweep lists is either a cell or a *filtered* entry that says why it cannot
be valid (the strategy's own validation, or the world size not being a multiple of the model
group); nothing is dropped silently.
"""

from __future__ import annotations

import itertools
import math
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from tspbench.core.config import ConfigError, get_config
from tspbench.runtime.registry import get_strategy
from tspbench.runtime.spec import RunSpec, parse_size


@dataclass(frozen=True)
class Cell:
    """One run of a sweep: its spec and the sweep that listed it first."""

    spec: RunSpec
    sweep: str

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def gpus(self) -> int:
        return self.spec.layout.world_size


def check_sweep(i: int, sweep: dict) -> None:
    """Sweep-level rules (ConfigError naming the field): every sequence length splits into 2D
    zigzag chunks and every GPU count holds whole model groups, for every degree of the sweep."""
    degrees = set(sweep["degrees"]) | {t * s for t, s in sweep.get("tpsp", [])}
    if "tpsp" in sweep["strategies"] and not sweep.get("tpsp"):  # the config's own key
        raise ConfigError(f"sweeps[{i}].tpsp: list the T x Sigma factorisations, e.g. [[2, 2]]")
    for t, s in sweep.get("tpsp", []):
        if t * s not in sweep["degrees"]:
            raise ConfigError(
                f"sweeps[{i}].tpsp: [{t}, {s}] has T x Sigma = {t * s}, not one of "
                f"sweeps[{i}].degrees {sweep['degrees']}"
            )
    for D in sorted(degrees):
        for S in sweep["seq_lens"]:
            if S % (2 * D):
                raise ConfigError(
                    f"sweeps[{i}].seq_lens: {S} must be divisible by 2*D = {2 * D} "
                    f"(zigzag sharding at degree {D})"
                )
        for g in sweep["gpus"]:
            if g % D:
                raise ConfigError(
                    f"sweeps[{i}].gpus: {g} must be a multiple of the model group D = {D}"
                )


SCHEMA = Path(__file__).resolve().parents[2] / "workflows/schemas/config.schema.yaml"


def load_config(path: str) -> dict:
    """Read (safely) and validate a sweep config: ConfigError names the field and the rule."""
    import jsonschema

    try:
        config = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"config {path!r}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config {path!r}: not valid YAML ({e})".replace("\n", " ")) from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"config {path!r}: must be a mapping of settings, got {type(config).__name__}"
        )
    try:
        jsonschema.validate(config, yaml.safe_load(SCHEMA.read_text()))
    except jsonschema.ValidationError as e:
        where = ".".join(map(str, e.absolute_path)) or "(top level)"
        raise ConfigError(f"config {path!r}: {where}: {e.message}") from None
    sweep_cells(config)
    return config


def sweep_cells(config: dict) -> tuple[list[Cell], list[dict]]:
    """(valid cells in config order, filtered combinations with their reasons).

    Sweep-level mistakes are config errors (:func:`check_sweep`); a combination that cannot be
    valid for one strategy (heads not divisible by T, a batch DP cannot split) is filtered with
    its reason, never dropped silently.
    """
    cfg = get_config(config["model"], **config.get("model_overrides", {}))
    common = {
        "dtype": config["dtype"],
        "warmup": config["warmup"],
        "steps": config["steps"],
        "seed": config.get("seed", 0),
        "recompute": config.get("recompute", "none"),
        "max_memory": parse_size(str(config["max_memory"])) if config.get("max_memory") else None,
        "quiet": True,
    }
    cells: dict[str, Cell] = {}
    filtered: list[dict] = []
    for i, sweep in enumerate(config["sweeps"]):
        check_sweep(i, sweep)
        combos = itertools.product(
            sweep["strategies"], sweep["gpus"], sweep["seq_lens"], sweep["batches"], sweep["modes"]
        )
        for strategy, gpus, S, B, mode in combos:
            impl = get_strategy(strategy)
            for lay in impl.sweep_layouts(sweep["degrees"], sweep.get("tpsp", [])):
                lay = replace(lay, dp=gpus // lay.degree)
                fields = {"seq_len": S, "batch": B, "mode": mode, **common}
                try:
                    spec = RunSpec(strategy=strategy, cfg=cfg, layout=lay, **fields)
                except ConfigError as e:
                    cell_id = f"{impl.tag(lay)}.D{lay.degree}.g{gpus}.S{S}.B{B}.{mode}"
                    filtered.append(
                        {
                            "strategy": strategy,
                            "degree": lay.degree,
                            "tp": lay.tp,
                            "sp": lay.sp,
                            "gpus": gpus,
                            "seq_len": S,
                            "batch": B,
                            "mode": mode,
                            "sweep": sweep["name"],
                            "cell": cell_id,
                            "reason": str(e),
                        }
                    )
                    continue
                cells.setdefault(spec.id, Cell(spec, sweep["name"]))
    return list(cells.values()), filtered


def command(cell: Cell, config: dict, python: str) -> str:
    """The shell line that runs a cell: local ranks, or one Slurm task per rank under srun."""
    args = [python, "-m", "tspbench", "run", *run_args(cell, config)]
    if config["launcher"] == "srun":
        # explicit geometry: the plugin's job step drops the inherited task settings, and a bare
        # srun would start a single task
        res = slurm_resources(cell, config)
        srun = [
            "srun",
            f"--nodes={res['nodes']}",
            f"--ntasks={cell.gpus}",
            f"--ntasks-per-node={res['tasks_per_node']}",
        ]
        return " ".join(shlex.quote(a) for a in [*srun, *args, "--launch", "env"])
    return " ".join(shlex.quote(a) for a in [*args, "--launch", "local", "--nproc", str(cell.gpus)])


def run_args(cell: Cell, config: dict) -> list[str]:
    """The ``tspbench run`` arguments of a cell (launcher and output are the rule's business)."""
    args = cell.spec.to_argv()
    if config.get("timeout"):
        args += ["--timeout", str(config["timeout"])]
    return args


def slurm_resources(cell: Cell, config: dict) -> dict:
    """A cell's Slurm job: nodes, one task per rank (tasks_per_node), GPUs per node as gres,
    ``mpi`` (srun starts the ranks; the plugin wants it only for more than one task per node),
    and a runtime in minutes that grows with S (and, in the rule, with each retry)."""
    per_node = min(cell.gpus, config["gpus_per_node"])
    base = config.get("runtime_minutes", 20)
    return {
        "nodes": math.ceil(cell.gpus / config["gpus_per_node"]),
        "tasks_per_node": per_node,
        "gres": f"gpu:{per_node}" if config.get("gpu", False) else "",
        "mpi": "srun" if per_node > 1 else "",
        "runtime": int(base * max(1, cell.spec.seq_len / config.get("runtime_base_seq", 16384))),
    }
