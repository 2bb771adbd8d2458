# Helpers for the rules (functions only; the logic lives in tspbench.pipeline).
import shlex

from tspbench.pipeline.claim_checks import Sources


def cell_of(wildcards):
    return CELLS[wildcards.cell]


def cell_resource(key):
    return lambda wildcards: slurm_resources(cell_of(wildcards), config)[key]


def runtime(wildcards, attempt):
    """Minutes: grows with the sequence length, and with each retry."""
    return slurm_resources(cell_of(wildcards), config)["runtime"] * attempt


def run_threads(wildcards):
    return cell_of(wildcards).gpus if config["launcher"] == "local" else 1


def run_line(wildcards, output, resources):
    """The cell's shell line. ``--cell``: an error is a result (exit 0, record written), an
    interruption is not (its record goes beside the output). Local ranks: ``exec``, so the
    launcher is Snakemake's own child and dies with it (parent-death signal); under srun the
    step's exit code is the worst rank's, so the record, not the code, says whether it ran.
    Stops (and records why) before the scheduler's runtime runs out."""
    limit = max(30, resources.runtime * 60 - 30)
    log = shlex.quote(f"logs/{NAME}/run/{wildcards.cell}.log")
    out = shlex.quote(output[0])
    cmd = command(cell_of(wildcards), config, PYTHON)
    line = f"{cmd} --out {out} --time-limit {limit} --cell > {log} 2>&1"
    if config["launcher"] == "local":
        return f"exec {line}"
    return f"{line} || true; test -s {out}"


def claims_projected() -> str:
    """Fresh projected tables under the workdir, else the committed references beside the
    Snakefile (a workdir of its own, such as .test/, has none)."""
    here = Sources.find().projected
    if here.exists():
        return str(here)
    return str(Sources.find(Path(workflow.basedir)).projected)
