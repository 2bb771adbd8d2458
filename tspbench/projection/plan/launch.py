"""How to run a planned cell: the ``tspbench run`` and ``srun`` lines and the sweep config
snippet (workflows/config/*.yaml) that ``tspbench plan`` prints and writes for its best row. A
model that is no preset is spelt as the nearest preset with overrides. Split from the rendering:
it speaks the run and pipeline interfaces, not the table's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tspbench.core.config import PRESETS, ModelConfig
from tspbench.projection import costmodel
from tspbench.projection.node import node_share
from tspbench.projection.plan.types import Request, node_size
from tspbench.runtime.spec import RunSpec


def nearest_preset(cfg: ModelConfig, names: list[str] | None = None) -> str:
    """The preset (of ``names``) that differs from ``cfg`` in the fewest fields."""
    fields = [f.name for f in dataclasses.fields(cfg) if f.name != "name"]
    names = [n for n in (names or list(PRESETS)) if n in PRESETS]
    return min(names, key=lambda n: sum(getattr(PRESETS[n], f) != getattr(cfg, f) for f in fields))


def run_argv(spec: RunSpec) -> list[str]:
    """``tspbench run`` arguments of a spec; a model that is no preset is spelt as the nearest
    preset with ``--set`` for every field that differs."""
    cfg, spec = spec.cfg, spec.replace(quiet=False)
    if PRESETS.get(cfg.name) != cfg:
        spec = spec.replace(cfg=dataclasses.replace(cfg, name=nearest_preset(cfg)))
    return spec.to_argv()


def run_lines(req: Request, spec: RunSpec, out: str = "runs/plan.json") -> dict[str, str]:
    """The ``tspbench run`` line (one node: local ranks; more: one rank per Slurm task) and the
    ``srun`` line for the cluster."""
    import shlex

    G, node = spec.layout.world_size, node_size(req.hardware)  # decode: one model group
    argv = [*run_argv(spec), "--device", "cuda", "--out", out]
    if G <= node:
        run = ["tspbench", "run", *argv, "--launch", "local", "--nproc", str(G)]
    else:  # started once per rank by srun or torchrun
        run = ["tspbench", "run", *argv, "--launch", "env"]
    per = min(G, node)
    host = []
    if req.hardware.get("node"):  # the rank's share of the node (projection/node.py)
        share = node_share(req.hardware, node, per)
        host = [f"--cpus-per-task={share['cpus_per_task']}", f"--mem={share['mem_mb']}M"]
        host += ["--exclusive"] if share["exclusive"] else []
    srun = ["srun", f"--nodes={math.ceil(G / node)}", f"--ntasks={G}",
            f"--ntasks-per-node={per}", f"--gpus-per-node={per}", *host,
            "--kill-on-bad-exit=1", "python", "-m", "tspbench", "run", *argv,
            "--launch", "env"]  # fmt: skip
    return {"run": shlex.join(run), "srun": shlex.join(srun)}


def pipeline_config(req: Request, spec: RunSpec, models: list[str] | None = None) -> str:
    """A sweep config (workflows/config/*.yaml) that runs the planned cell on the cluster;
    ``models``: the presets the config schema accepts."""
    import yaml

    base = nearest_preset(spec.cfg, models)
    over = {
        f.name: getattr(spec.cfg, f.name)
        for f in dataclasses.fields(spec.cfg)
        if f.name != "name" and getattr(spec.cfg, f.name) != getattr(PRESETS[base], f.name)
    }
    lay, impl = spec.layout, spec.impl
    sweep: dict[str, Any] = {"name": "plan", "strategies": [spec.strategy], "degrees": [lay.degree]}
    if impl.factors(lay)["tp"] is not None:
        sweep["tpsp"] = [[lay.tp, lay.sp]]
    sweep.update(gpus=[lay.world_size], seq_lens=[req.seq_len], batches=[spec.batch],
                 modes=[req.mode])  # fmt: skip
    if lay.pp > 1:  # gpus: the whole world, pp x D x dp
        sweep.update(pp=lay.pp, pp_schedule=spec.pp_schedule, microbatches=spec.microbatches)
    if spec.decoding:
        sweep["new_tokens"] = [spec.new_tokens]
    own = {o.name: o.default for o in impl.options}
    options = {k: v for k, v in spec.options.items() if v != own[k]}
    if options:  # the strategy's options away from their defaults
        sweep["options"] = options
    hw = req.hardware.get("name")
    config: dict[str, Any] = {"name": f"plan-{base}-S{req.seq_len}-g{req.gpus}", "model": base}
    if over:
        config["model_overrides"] = over
    config.update(dtype=req.dtype, warmup=1, steps=3, recompute=spec.recompute, timeout=600,
                  gpu=True, gpus_per_node=node_size(req.hardware), launcher="srun")  # fmt: skip
    if hw in costmodel.presets():
        config["hardware_preset"] = hw
        if req.hardware.get("node"):
            config["node_resources"] = "preset"
    config["sweeps"] = [sweep]
    head = f"# tspbench plan: {spec.label} D={lay.degree} dp={lay.dp} B={spec.batch}"
    if lay.pp > 1:
        head += f" pp={lay.pp} {spec.pp_schedule} M={spec.microbatches}"
    if spec.decoding and req.gpus > lay.world_size:
        head += f" (one of {req.gpus // lay.world_size} model groups that serve apart)"
    return head + "\n" + yaml.safe_dump(config, sort_keys=False, default_flow_style=None)
