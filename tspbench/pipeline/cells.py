"""A sweep config becomes cells: one (strategy, layout, S, batch, mode) run each.

Every combination a sweep lists is either a cell or a *filtered* entry that says why it cannot
be valid (the strategy's own validation, or the world size not being a multiple of the model
group); nothing is dropped silently.
"""

from __future__ import annotations

import itertools
import math
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from tspbench.core.config import ConfigError, get_config
from tspbench.core.strategy import Layout
from tspbench.registry import get_strategy


@dataclass(frozen=True)
class Cell:
    strategy: str
    degree: int
    tp: int
    sp: int
    gpus: int
    seq_len: int
    batch: int
    mode: str
    sweep: str

    @property
    def dp(self) -> int:
        return self.gpus // self.degree

    @property
    def id(self) -> str:
        tag = f"{self.strategy}-{self.tp}x{self.sp}" if self.strategy == "tpsp" else self.strategy
        return f"{tag}.D{self.degree}.g{self.gpus}.S{self.seq_len}.B{self.batch}.{self.mode}"

    def layout(self) -> Layout:
        return Layout(degree=self.degree, tp=self.tp, sp=self.sp, dp=self.dp)


def _layouts(
    strategy: str, degrees: list[int], tpsp: list[list[int]]
) -> list[tuple[int, int, int]]:
    """(degree, tp, sp) of a strategy in a sweep; tpsp takes its listed T x Sigma factorisations."""
    if strategy == "tpsp":
        return [(t * s, t, s) for t, s in tpsp if t * s in degrees]
    if strategy == "single":
        return [(1, 1, 1)]
    return [(d, 1, 1) for d in degrees]


def check_sweep(i: int, sweep: dict) -> None:
    """Sweep-level rules (ConfigError naming the field): every sequence length splits into 2D
    zigzag chunks and every GPU count holds whole model groups, for every degree of the sweep."""
    degrees = set(sweep["degrees"]) | {t * s for t, s in sweep.get("tpsp", [])}
    if "tpsp" in sweep["strategies"] and not sweep.get("tpsp"):
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
    cells: dict[str, Cell] = {}
    filtered: list[dict] = []
    for i, sweep in enumerate(config["sweeps"]):
        check_sweep(i, sweep)
        combos = itertools.product(
            sweep["strategies"], sweep["gpus"], sweep["seq_lens"], sweep["batches"], sweep["modes"]
        )
        for strategy, gpus, S, B, mode in combos:
            for degree, tp, sp in _layouts(strategy, sweep["degrees"], sweep.get("tpsp", [])):
                cell = Cell(strategy, degree, tp, sp, gpus, S, B, mode, sweep["name"])
                try:
                    get_strategy(strategy).validate(cfg, cell.layout(), S, B)
                except ConfigError as e:
                    filtered.append({**asdict(cell), "cell": cell.id, "reason": str(e)})
                    continue
                cells.setdefault(cell.id, cell)
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
    args = [
        "--strategy",
        cell.strategy,
        "--model",
        config["model"],
        "--seq-len",
        str(cell.seq_len),
        "--degree",
        str(cell.degree),
        "--dp",
        str(cell.dp),
        "--batch",
        str(cell.batch),
        "--mode",
        cell.mode,
        "--dtype",
        config["dtype"],
        "--warmup",
        str(config["warmup"]),
        "--steps",
        str(config["steps"]),
        "--seed",
        str(config.get("seed", 0)),
        "--recompute",
        config.get("recompute", "none"),
        "--quiet",
    ]
    if cell.strategy == "tpsp":
        args += ["--tp", str(cell.tp), "--sp", str(cell.sp)]
    for k, v in config.get("model_overrides", {}).items():
        args += ["--set", f"{k}={v}"]
    if config.get("max_memory"):
        args += ["--max-memory", str(config["max_memory"])]
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
        "runtime": int(base * max(1, cell.seq_len / config.get("runtime_base_seq", 16384))),
    }
