# Paper scale without the hardware: `snakemake project` (workflows/config/projected.yaml).
# One fake-tensor estimate per memory cell, then projected tables and figures.
import shlex

from tspbench.pipeline.projected import (
    load as load_projected,
    memory_cells,
    report_files,
)

PROJ_CONFIG = os.path.join(workflow.basedir, "workflows/config/projected.yaml")
try:  # checked against tspbench/schemas/projected.schema.yaml before any shell line
    PROJ = load_projected(PROJ_CONFIG)
    PROJ_CELLS = {c.id: c for c in memory_cells(PROJ)}
except ConfigError as e:
    raise ValueError(f"config error: {e}") from None
PROJ_OUT = "results/projected"
PROJ_PLOTS = "plots/projected"


rule project:
    input:
        f"{PROJ_OUT}/memory.md",


rule estimate:
    output:
        f"{PROJ_OUT}/estimates/{{pcell}}.json",
    log:
        f"logs/projected/{{pcell}}.log",
    conda:
        "../../env/environment.yml"
    params:
        python=PYTHON,
        args=lambda wc: shlex.join(PROJ_CELLS[wc.pcell].args()),
        mem=PROJ["device_memory_gib"],
    shell:
        "{params.python:q} -m tspbench estimate {params.args} --device-memory {params.mem:q}"
        " --out {output:q} > {log:q} 2>&1"


rule projected_report:
    input:
        expand(f"{PROJ_OUT}/estimates/{{pcell}}.json", pcell=PROJ_CELLS),
    output:
        f"{PROJ_OUT}/memory.md",  # first: the directory the tables go to
        [f"{PROJ_OUT}/{name}" for name in report_files(PROJ) if name != "memory.md"],
        plots=directory(PROJ_PLOTS),
    log:
        "logs/projected/report.log",
    conda:
        "../../env/environment.yml"
    params:
        python=PYTHON,
        config=PROJ_CONFIG,
        estimates=lambda wc, input: os.path.dirname(input[0]),
        out=lambda wc, output: os.path.dirname(output[0]),
        plots=lambda wc, output: output.plots,
    shell:
        "{params.python:q} -m tspbench projected-report --config {params.config:q}"
        " --estimates {params.estimates:q} --out {params.out:q} --plots {params.plots:q}"
        " > {log:q} 2>&1"
