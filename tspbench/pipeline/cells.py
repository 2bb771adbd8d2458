"""A sweep config becomes cells: one (strategy, layout, S, batch, mode) run each.

Every combination a sweep lists is either a cell or a *filtered* entry that says why it cannot
be valid (the strategy's own validation, or the world size not being a multiple of the model
group); nothing is dropped silently.
"""

from __future__ import annotations

import functools
import itertools
import math
import shlex
import stat
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from tspbench.core.config import ConfigError, get_config
from tspbench.core.strategy import Layout
from tspbench.runtime.registry import get_strategy
from tspbench.runtime.spec import RunSpec, mlp_tag, parse_size


@dataclass(frozen=True)
class Cell:
    """One run: its spec and every sweep that lists it, in config order. A cell listed by two
    sweeps (the D = 8 column of a degree sweep is also the seq sweep's) runs once and writes one
    record, and counts in each sweep's tables and figures."""

    spec: RunSpec
    sweeps: tuple[str, ...]

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


ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "workflows/schemas/config.schema.yaml"
# every combination becomes a RunSpec at parse time (~60 us each): more than this is a typo, and
# would stall every snakemake start
MAX_COMBINATIONS = 10_000
# Slurm minutes per cell: the run rule doubles it on the retry and passes it on as --time-limit,
# which the CLI accepts up to a week
MAX_RUNTIME_MIN = 3 * 24 * 60
MAX_YAML_BYTES = 2**20  # configs and tolerances are a few kB


class _NoAliasLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases: nine nested aliases ("billion laughs") make a tiny file
    whose object is shared references, and anything that walks or prints it runs out of memory."""

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ConfigError(
                f"line {event.start_mark.line + 1}: YAML alias *{event.anchor}: aliases are not "
                f"allowed (write the value out)"
            )
        return super().compose_node(parent, index)


def read_yaml(path: str | Path, what: str) -> Any:
    """The YAML document at ``path``, parsed without aliases; ConfigError (one line) if the file
    cannot be read or is not YAML."""
    try:
        info = Path(path).stat()
        if not stat.S_ISREG(info.st_mode):  # a FIFO would block forever, a device never end
            raise ConfigError("not a regular file")
        if info.st_size > MAX_YAML_BYTES:
            raise ConfigError(f"larger than {MAX_YAML_BYTES} bytes, not a settings file")
        return yaml.load(Path(path).read_text(), Loader=_NoAliasLoader)
    except OSError as e:
        raise ConfigError(f"{what} {str(path)!r}: cannot read it ({e.strerror})") from None
    except ConfigError as e:
        raise ConfigError(f"{what} {str(path)!r}: {e}") from None
    except (yaml.YAMLError, RecursionError, UnicodeDecodeError) as e:
        text = str(e).replace("\n", " ")
        raise ConfigError(f"{what} {str(path)!r}: not valid YAML ({text})") from None


def non_finite(obj: object) -> tuple[str, float] | None:
    """(dotted path, value) of the first NaN or infinity in ``obj``: JSON Schema bounds never
    refuse NaN (every comparison with it is false), so a NaN timeout passes ``minimum``.

    A list or mapping met twice is a YAML alias that reached us already parsed (snakemake loads
    ``--configfile`` itself): a ConfigError, before anything walks it exponentially often.
    """
    queue: deque[tuple[str, object]] = deque([("", obj)])  # breadth first: the shortest path
    seen: set[int] = set()
    while queue:
        where, v = queue.popleft()
        if isinstance(v, float) and not math.isfinite(v):
            return where or "(top level)", v
        if not isinstance(v, (dict, list)):
            continue
        if id(v) in seen:
            raise ConfigError(f"{where}: a value used twice (a YAML alias?): write it out")
        seen.add(id(v))
        items = v.items() if isinstance(v, dict) else enumerate(v)
        queue.extend((f"{where}.{k}" if where else str(k), x) for k, x in items)
    return None


@functools.cache
def _validator(schema: Path) -> Any:
    """``schema``'s validator, with integers that are ints: JSON Schema counts 2.0 as an integer,
    and the CLI refuses "2.0" (cached: aggregate checks every record of a sweep)."""
    import jsonschema

    spec = yaml.safe_load(schema.read_text())
    base = jsonschema.validators.validator_for(spec)
    strict = base.TYPE_CHECKER.redefine(
        "integer", lambda _, v: isinstance(v, int) and not isinstance(v, bool)
    )
    return jsonschema.validators.extend(base, type_checker=strict)(spec)


def check_schema(obj: object, schema: Path, what: str, finite: bool = True) -> None:
    """Validate ``obj`` against ``schema`` (strict integers; with ``finite``, no NaN or infinity
    anywhere); ConfigError naming the field, the value and the rule, on one line."""
    import jsonschema

    try:
        bad = non_finite(obj)
    except ConfigError as e:
        raise ConfigError(f"{what}: {e}") from None
    if finite and bad:
        raise ConfigError(f"{what}: {bad[0]}: {bad[1]!r} is not a finite number")
    error = jsonschema.exceptions.best_match(_validator(schema).iter_errors(obj))
    if error is not None:
        where = ".".join(map(str, error.absolute_path)) or "(top level)"
        message = error.message  # the value's repr, then the rule: keep both ends of a long one
        message = message if len(message) <= 300 else f"{message[:200]} ... {message[-100:]}"
        raise ConfigError(f"{what}: {where}: {message}")


def load_config(path: str) -> dict:
    """Read (safely) and validate a sweep config: ConfigError names the field and the rule."""
    config = read_yaml(path, "config")
    if not isinstance(config, dict):
        raise ConfigError(
            f"config {path!r}: must be a mapping of settings, got {type(config).__name__}"
        )
    sweep_cells(config, f"config {path!r}")
    return config


def _common(config: dict, what: str) -> dict:
    """The run settings every cell shares (max_memory parsed: "0.1" passes the pattern)."""
    mem = config.get("max_memory")
    try:
        max_memory = parse_size(str(mem)) if mem else None
    except ValueError as e:
        raise ConfigError(f"{what}: max_memory: {e}") from None
    return {
        "dtype": config["dtype"],
        "warmup": config["warmup"],
        "steps": config["steps"],
        "seed": config.get("seed", 0),
        "recompute": config.get("recompute", "none"),
        "max_memory": max_memory,
        "mlp_schedule": config.get("mlp_schedule", "ring"),
        "quiet": True,
    }


def _check_size(config: dict, what: str) -> None:
    """Refuse a sweep too large to enumerate before enumerating it."""
    n = sum(
        math.prod(len(s[k]) for k in ("strategies", "gpus", "seq_lens", "batches", "modes"))
        * (len(s["degrees"]) + len(s.get("tpsp", [])))
        for s in config["sweeps"]
    )
    if n > MAX_COMBINATIONS:
        raise ConfigError(
            f"{what}: sweeps: {n} combinations, more than {MAX_COMBINATIONS}: split the sweep"
        )


def _filtered(
    sweep: dict, strategy: str, lay: Layout, gpus: int, combo: dict, why: str, run: dict
) -> dict:
    """A combination that cannot run, with its reason (``combo``: seq_len, batch, mode; ``run``:
    the settings every cell shares, the MLP schedule among them)."""
    S, B, mode = combo["seq_len"], combo["batch"], combo["mode"]
    tag = mlp_tag(get_strategy(strategy).tag(lay), run["mlp_schedule"])
    return {
        "strategy": strategy,
        "degree": lay.degree,
        "tp": lay.tp,
        "sp": lay.sp,
        "gpus": gpus,
        **combo,
        "sweep": sweep["name"],
        "cell": f"{tag}.D{lay.degree}.g{gpus}.S{S}.B{B}.{mode}",
        "reason": why,
    }


def sweep_cells(config: dict, what: str = "config") -> tuple[list[Cell], list[dict]]:
    """(valid cells in config order, filtered combinations with their reasons).

    The config is validated first (schema with strict integers, finite numbers, size), since the
    Snakefile and ``check-config`` both start here. Sweep-level mistakes are config errors
    (:func:`check_sweep`); a combination that cannot be valid for one strategy (heads not
    divisible by T, a batch DP cannot split) is filtered with its reason, never dropped silently;
    a config whose every combination is filtered is an error.
    """
    check_schema(config, SCHEMA, what)
    _check_size(config, what)
    cfg = get_config(config["model"], **config.get("model_overrides", {}))
    common = _common(config, what)
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
                combo = {"seq_len": S, "batch": B, "mode": mode}
                # TSP's MLP schedule; the other strategies have none to choose (ring, unused)
                mlp = common["mlp_schedule"]
                run = {**common, "mlp_schedule": mlp if mlp in impl.mlp_schedules else "ring"}
                try:
                    spec = RunSpec(strategy=strategy, cfg=cfg, layout=lay, **combo, **run)
                except ConfigError as e:
                    why = str(e)
                    filtered.append(_filtered(sweep, strategy, lay, gpus, combo, why, run))
                    continue
                known = cells.get(spec.id)
                if known is None:
                    cells[spec.id] = Cell(spec, (sweep["name"],))
                elif sweep["name"] not in known.sweeps:  # one run, counted in both sweeps
                    cells[spec.id] = replace(known, sweeps=(*known.sweeps, sweep["name"]))
    if not cells:
        reasons = sorted({f["reason"] for f in filtered})
        raise ConfigError(
            f"{what}: no runnable cell: all {len(filtered)} combinations are filtered "
            f"({'; '.join(reasons[:3])}{'; ...' if len(reasons) > 3 else ''})"
        )
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
            f"--cpus-per-task={res['cpus_per_task']}",
            "--kill-on-bad-exit=1",  # one dead rank ends the step: no GPUs held until a timeout
        ]
        return " ".join(shlex.quote(a) for a in [*srun, *args, "--launch", "env"])
    return " ".join(shlex.quote(a) for a in [*args, "--launch", "local", "--nproc", str(cell.gpus)])


def run_args(cell: Cell, config: dict) -> list[str]:
    """The ``tspbench run`` arguments of a cell (launcher and output are the rule's business);
    a GPU sweep's cells insist on a GPU (``--device cuda``: exit 2, never a silent CPU run)."""
    args = cell.spec.to_argv()
    if config.get("timeout"):
        args += ["--timeout", str(config["timeout"])]
    return args + (["--device", "cuda"] if config.get("gpu", False) else [])


def check_gpu_build(config: dict) -> None:
    """A GPU sweep (``gpu: true``) with a torch built without CUDA or ROCm would run every cell
    on the CPU with gloo: stop before any cell, naming the problem."""
    import torch

    if config.get("gpu", False) and not (torch.version.cuda or torch.version.hip):
        raise ConfigError(
            f"gpu: true, but this torch ({torch.__version__}) is built without CUDA or ROCm: "
            "install the build for the cluster's GPUs (env/install.sh --torch-index ...)"
        )


def slurm_resources(cell: Cell, config: dict) -> dict:
    """A cell's Slurm job: nodes, one task per rank (tasks_per_node), GPUs per node as gres,
    ``mpi`` (srun starts the ranks; the plugin wants it only for more than one task per node),
    CPUs per task, memory per node (``mem_mb``, the site's default when unset), ``--exclusive``
    nodes on request, and a runtime in minutes that grows with S, is a fraction of it for a
    forward-only cell (``infer_runtime_fraction``) and grows, in the rule, with each retry."""
    per_node = min(cell.gpus, config["gpus_per_node"])
    base = config.get("runtime_minutes", 20)
    if cell.spec.mode != "train":
        base = max(1, round(base * config.get("infer_runtime_fraction", 0.25)))
    return {
        "cpus_per_task": config.get("cpus_per_task", 1),
        "mem_mb": config.get("mem_mb") or 0,  # 0: no --mem, the site's default
        "slurm_extra": "--exclusive" if config.get("exclusive", False) else "",
        "nodes": math.ceil(cell.gpus / config["gpus_per_node"]),
        "tasks_per_node": per_node,
        "gres": f"gpu:{per_node}" if config.get("gpu", False) else "",
        "mpi": "srun" if per_node > 1 else "",
        "runtime": min(
            MAX_RUNTIME_MIN,
            int(base * max(1, cell.spec.seq_len / config.get("runtime_base_seq", 16384))),
        ),
    }
