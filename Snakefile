# tspbench pipeline: sweep -> records -> aggregate table -> tables, figures, report.
#   snakemake --cores 2                      the default CPU sweep (workflows/config/default.yaml)
#   snakemake --profile slurm --configfile workflows/config/paper.yaml    a GPU cluster
#   snakemake project --cores 2              paper-scale projections (workflows/config/projected.yaml)
# Helpers live in the tspbench package; this file only wires them.
import json
import os
import re
import sys
from pathlib import Path

import yaml
from snakemake.utils import min_version, validate

from tspbench.core import datafiles
from tspbench.core.config import ConfigError
from tspbench.pipeline.cells import (
    check_gpu_build,
    command,
    slurm_resources,
    sweep_cells,
)

min_version("9.0")

# No --configfile: the working directory's config/config.yaml where there is one (the workflow
# catalog's convention: `snakemake --directory .test` runs .test/config/config.yaml), else the
# embedded default; --config keys on top. By hand, not `configfile:`, which merges dictionaries:
# the default's keys (model_overrides, note, launcher) would leak into every other config.
if "sweeps" not in config:
    _own = Path("config/config.yaml")
    _cfg = (
        _own
        if _own.is_file()
        else workflow.source_path("workflows/config/default.yaml")
    )
    with open(_cfg) as f:
        config = {**yaml.safe_load(f), **config}
try:  # tspbench's checks first: strict integers, finite numbers, no aliases, runnable cells
    CELLS_LIST, FILTERED = sweep_cells(config)
except ConfigError as e:
    raise ValueError(f"config error: {e}") from None
# the same schema again, for the defaults it fills in (the packaged file: its strategy list is
# filled in by tspbench's check above, which snakemake's validate would not do)
validate(config, str(datafiles.path("schemas/config.schema.yaml")))
CELLS = {c.id: c for c in CELLS_LIST}
NAME = config["name"]
OUT = f"results/{NAME}"
PLOTS = f"plots/{NAME}"
# Inside a software environment (--sdm conda or apptainer) the rules call that environment's
# python, which imports tspbench from the working directory (`python -m` puts it first on the
# path; the image's /opt/tspbench is the fallback); without one, the interpreter running
# snakemake (the installed .venv).
SDM = {m.name.lower() for m in workflow.deployment_settings.deployment_method}
PYTHON = "python" if SDM & {"conda", "apptainer"} else sys.executable


include: "workflows/rules/environments.smk"


# the report's landing page: the claims table and the figures
report: "workflows/report/workflow.rst"


# --sdm apptainer: every rule runs in this image (build it: env/tspbench.def)
container: config.get("container", "tspbench.sif")


onstart:
    # not on a dry run (it runs no cell, and a login node may have a CPU torch)
    check_gpu_build(config, in_image="apptainer" in SDM)


wildcard_constraints:
    cell=r"[A-Za-z0-9_.-]+",


# cheap table work runs where snakemake runs, never as cluster jobs
localrules:
    all,
    sweep,
    aggregate,
    tables,
    figures,
    regress,
    project,
    projected_report,
    claims,
    plan,
    plan_map,
    plan_check,


include: "workflows/rules/common.smk"
include: "workflows/rules/run.smk"
include: "workflows/rules/report.smk"
include: "workflows/rules/regress.smk"
include: "workflows/rules/project.smk"
include: "workflows/rules/claims.smk"
include: "workflows/rules/plan.smk"


rule all:
    default_target: True
    input:
        f"{OUT}/summary.csv",
        f"{OUT}/tables/failures.md",
        f"{OUT}/claims.csv",
        f"{PLOTS}/png",
