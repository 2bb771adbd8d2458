# Helpers for the rules (functions only; the logic lives in tspbench.pipeline).


def cell_of(wildcards):
    return CELLS[wildcards.cell]


def cell_resource(key):
    return lambda wildcards: slurm_resources(cell_of(wildcards), config)[key]


def runtime(wildcards, attempt):
    """Minutes: grows with the sequence length, and with each retry."""
    return slurm_resources(cell_of(wildcards), config)["runtime"] * attempt


def run_threads(wildcards):
    return cell_of(wildcards).gpus if config["launcher"] == "local" else 1
