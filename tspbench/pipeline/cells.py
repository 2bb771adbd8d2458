"""A sweep config becomes cells: one (strategy, layout, S, batch, mode) run each, and for the
decode modes (``decode``, ``generate``: ``seq_lens`` are prompt lengths) one per ``new_tokens``.

Every combination a sweep lists is either a cell or a *filtered* entry that says why it cannot
be valid (the strategy's own validation, or the world size not being a multiple of the model
group); nothing is dropped silently.
"""

from __future__ import annotations

import itertools
import math
import os
import shlex
from dataclasses import dataclass, replace

from tspbench.core.config import ConfigError, ModelConfig, get_config
from tspbench.core.configfile import check_schema, non_finite, read_yaml
from tspbench.core.options import Options
from tspbench.core.strategy import Layout
from tspbench.pipeline.resources import slurm_resources
from tspbench.runtime.local import max_local_ranks
from tspbench.runtime.registry import all_options, get_strategy, names, strategies, takers
from tspbench.runtime.spec import (
    DECODE_MODES,
    DEFAULT_NEW_TOKENS,
    RunSpec,
    experts_tag,
    parse_size,
)

__all__ = [
    "Cell",
    "check_gpu_build",
    "check_schema",
    "check_sweep",
    "command",
    "load_config",
    "new_tokens",
    "non_finite",
    "read_yaml",
    "run_args",
    "slurm_resources",
    "sweep_cells",
]


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
    if any(strategies()[s].factored for s in sweep["strategies"]) and not sweep.get("tpsp"):
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
        pp = sweep.get("pp", 1)
        for g in sweep["gpus"]:
            if g % (D * pp):
                stages = f" x pp = {D * pp}" if pp > 1 else ""
                raise ConfigError(
                    f"sweeps[{i}].gpus: {g} must be a multiple of the model group D = {D}{stages}"
                )
    if sweep.get("pp", 1) == 1 and ("pp_schedule" in sweep or "microbatches" in sweep):
        raise ConfigError(f"sweeps[{i}].pp_schedule, microbatches: only with sweeps[{i}].pp > 1")
    check_decode_sweep(i, sweep)
    check_options(i, sweep)


def check_options(i: int, sweep: dict) -> None:
    """A sweep's ``options`` are strategy options (tspbench/core/options.py) that one of its
    strategies declares, each with a value the option takes."""
    values = {k: [v] for k, v in sweep.get("options", {}).items()}
    check_option_values(f"sweeps[{i}].options", values, sweep["strategies"])


def check_option_values(where: str, options: dict[str, list], strategies: list[str]) -> None:
    """Each of ``options`` (name: its values) is declared by one of ``strategies`` and takes
    each value: one ConfigError naming ``where``, the option and the rule otherwise."""
    known = all_options()
    for name, values in options.items():
        at = f"{where}.{name}"
        if name not in known:
            raise ConfigError(f"{at}: no strategy has this option (options: {', '.join(known)})")
        if not set(takers(name)) & set(strategies):
            raise ConfigError(
                f"{at}: none of the strategies given takes it (only {', '.join(takers(name))})"
            )
        for value in values:
            try:
                known[name].check(value)
            except ConfigError as e:
                raise ConfigError(f"{at}: {e}") from None


def _check_local(i: int, sweep: dict, launcher: str) -> None:
    """A local sweep asks no more ranks than this machine's launcher starts (else every cell
    would be refused after the schema had passed it)."""
    cap = max_local_ranks()
    for g in sweep["gpus"] if launcher == "local" else []:
        if g > cap:
            raise ConfigError(
                f"sweeps[{i}].gpus: {g}: launcher local starts at most {cap} ranks on this "
                f"machine ({os.cpu_count()} cores); use launcher srun"
            )


def new_tokens(sweep: dict, mode: str) -> list[int]:
    """Tokens generated per sequence, one cell each: the sweep's ``new_tokens`` for a decode
    mode (default 16, as ``tspbench run``), none (0) for train and infer."""
    return list(sweep.get("new_tokens", [DEFAULT_NEW_TOKENS])) if mode in DECODE_MODES else [0]


def check_decode_sweep(i: int, sweep: dict) -> None:
    """Decode rules of a sweep (ConfigError naming the field): ``new_tokens`` only with a decode
    mode; a sweep of decode modes only lists strategies with a decode path, and runs one model
    group (dp = 1), so every GPU count is one of its degrees (``single``, on one rank, gets an
    entry of its own: degrees [1], gpus [1], the same name puts it in the same figures)."""
    modes = set(sweep["modes"])
    if "new_tokens" in sweep and not modes & set(DECODE_MODES):
        raise ConfigError(
            f"sweeps[{i}].new_tokens: only modes {' and '.join(DECODE_MODES)} generate tokens "
            f"(modes: {sweep['modes']})"
        )
    if not modes or not modes <= set(DECODE_MODES):  # mixed with train/infer: filtered per cell
        return
    cannot = [s for s in sweep["strategies"] if strategies()[s].decoder is None]
    if cannot:
        can = ", ".join(n for n, s in strategies().items() if s.decoder is not None)
        raise ConfigError(
            f"sweeps[{i}].strategies: {', '.join(cannot)} has no decode path (modes "
            f"{sweep['modes']}); strategies that decode: {can}"
        )
    for ref in (s for s in sweep["strategies"] if strategies()[s].reference):
        if sweep["gpus"] != [1]:
            raise ConfigError(
                f"sweeps[{i}].strategies: {ref} decodes on one rank (gpus {sweep['gpus']}): give "
                "it a sweep entry of its own with degrees [1] and gpus [1] (it may share this name)"
            )
    for g in sweep["gpus"]:
        if g not in sweep["degrees"]:
            raise ConfigError(
                f"sweeps[{i}].gpus: {g} is not one of sweeps[{i}].degrees {sweep['degrees']}: "
                "decode runs one model group (dp = 1), so gpus = D"
            )


# every combination becomes a RunSpec at parse time (~60 us each): more than this is a typo, and
# would stall every snakemake start
MAX_COMBINATIONS = 10_000


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
        "quiet": True,
    }


def _check_size(config: dict, what: str) -> None:
    """Refuse a sweep too large to enumerate before enumerating it."""
    n = sum(
        math.prod(len(s[k]) for k in ("strategies", "gpus", "seq_lens", "batches"))
        * sum(len(new_tokens(s, mode)) for mode in s["modes"])
        * (len(s["degrees"]) + len(s.get("tpsp", [])))
        for s in config["sweeps"]
    )
    if n > MAX_COMBINATIONS:
        raise ConfigError(
            f"{what}: sweeps: {n} combinations, more than {MAX_COMBINATIONS}: split the sweep"
        )


def _filtered(
    sweep: dict, strategy: str, lay: Layout, gpus: int, combo: dict, why: str, run: dict,
    cfg: ModelConfig,
) -> dict:  # fmt: skip
    """A combination that cannot run, with its reason (``combo``: seq_len, batch, mode and, for
    a decode mode, new_tokens; ``run``: the cell's settings, its strategy's options among
    them)."""
    S, B, mode = combo["seq_len"], combo["batch"], combo["mode"]
    impl = get_strategy(strategy)
    tag = impl.tag(lay) + experts_tag(cfg)
    tag += Options(impl.options, run["options"], strategy).suffix("tag")
    if lay.pp > 1:  # (RunSpec's tag of a pipelined cell)
        tag += f"-pp{lay.pp}-{run['pp_schedule']}-m{run['microbatches'] or lay.pp}"
    n = f".N{combo['new_tokens']}" if combo.get("new_tokens") else ""
    return {
        "strategy": strategy,
        "degree": lay.degree,
        "tp": lay.tp,
        "sp": lay.sp,
        "gpus": gpus,
        **combo,
        "sweep": sweep["name"],
        "cell": f"{tag}.D{lay.degree}.g{gpus}.S{S}.B{B}.{mode}{n}",
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
    check_schema(config, "config.schema.yaml", what, strategies=names())
    _check_size(config, what)
    overrides = config.get("model_overrides", {})
    base = get_config(config["model"], **overrides)
    common = _common(config, what)
    cells: dict[str, Cell] = {}
    filtered: list[dict] = []
    for i, sweep in enumerate(config["sweeps"]):
        check_sweep(i, sweep)
        _check_local(i, sweep, config["launcher"])
        cfg = base
        if "model_overrides" in sweep:  # this sweep's model: the config's with its own fields
            try:
                cfg = get_config(config["model"], **{**overrides, **sweep["model_overrides"]})
            except ConfigError as e:
                raise ConfigError(f"{what}: sweeps[{i}].model_overrides: {e}") from None
        options = sweep.get("options", {})
        grid = itertools.product(
            sweep["strategies"], sweep["gpus"], sweep["seq_lens"], sweep["batches"], sweep["modes"]
        )
        combos = (
            (*c, n) for c in grid for n in new_tokens(sweep, c[-1])
        )  # one cell per new_tokens of a decode mode
        for strategy, gpus, S, B, mode, n in combos:
            impl = get_strategy(strategy)
            pp = sweep.get("pp", 1)
            for lay in impl.sweep_layouts(sweep["degrees"], sweep.get("tpsp", [])):
                lay = replace(lay, dp=gpus // (lay.degree * pp), pp=pp)
                combo = {"seq_len": S, "batch": B, "mode": mode}
                combo |= {"new_tokens": n} if n else {}
                # the sweep's options that this strategy declares (the rest are others')
                own = {o.name for o in impl.options}
                run = {**common, "options": {k: v for k, v in options.items() if k in own}}
                if pp > 1:
                    run["pp_schedule"] = sweep.get("pp_schedule", "1f1b")
                    run["microbatches"] = sweep.get("microbatches", 0)
                if mode in DECODE_MODES:  # no backward: a config's recompute is for training
                    run["recompute"] = "none"
                try:
                    spec = RunSpec(strategy=strategy, cfg=cfg, layout=lay, **combo, **run)
                except ConfigError as e:
                    why = str(e)
                    filtered.append(_filtered(sweep, strategy, lay, gpus, combo, why, run, cfg))
                    continue
                known = cells.get(spec.id)
                if known is not None and known.spec.cfg != spec.cfg:  # one id, two models
                    raise ConfigError(
                        f"{what}: sweeps[{i}] ({sweep['name']!r}): cell {spec.id} has another "
                        f"model than sweep {known.sweeps[0]!r}'s cell of that id (a sweep's "
                        "model_overrides): give the other model a config of its own"
                    )
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


def check_gpu_build(config: dict, in_image: bool = False) -> None:
    """A GPU sweep (``gpu: true``) with a torch built without CUDA or ROCm would run every cell
    on the CPU with gloo: stop before any cell, naming the problem. ``in_image``: the cells run
    inside an Apptainer image whose torch, not this one, is what counts; each cell's
    ``--device cuda`` then refuses a missing GPU (exit 2, the first cell stops the sweep)."""
    import torch

    if in_image:
        return
    if config.get("gpu", False) and not (torch.version.cuda or torch.version.hip):
        raise ConfigError(
            f"gpu: true, but this torch ({torch.__version__}) is built without CUDA or ROCm: "
            "install the build for the cluster's GPUs (env/install.sh --torch-index ...)"
        )
