# Plan maps: `snakemake plan --cores 2` (workflows/config/plan.yaml). For each model and hardware
# preset: which layout `tspbench plan` picks over sequence length x GPUs, each strategy's
# memory-feasible region and TSP's margin over the best other strategy (PROJECTED: analytic
# memory, cost model), as map.csv and PNG/PDF figures; and the planner's check against the
# committed measured and estimated cells (check.md). Operation counts are cached in
# ~/.cache/tspbench: the first map counts (minutes), later ones reuse the counts.
import re

from tspbench.projection.plan import load_config as load_plan_config

PLAN_CONFIG = os.path.join(workflow.basedir, "workflows/config/plan.yaml")
try:  # checked against tspbench/schemas/plan.schema.yaml before any shell line
    PLAN = load_plan_config(PLAN_CONFIG)
except ConfigError as e:
    raise ValueError(f"config error: {e}") from None
PLAN_OUT = f"results/{PLAN['name']}"
PLAN_MAPS = {f"{m['model']}-{m['hardware']}": m for m in PLAN["maps"]}
PLAN_FIGURES = ("winner", "feasible", "margin")
PLAN_REF = "results/reference"


wildcard_constraints:
    pmap="|".join(re.escape(k) for k in PLAN_MAPS),


rule plan:
    input:
        expand(f"{PLAN_OUT}/{{pmap}}/map.csv", pmap=PLAN_MAPS),
        f"{PLAN_OUT}/check.md",


rule plan_map:
    output:
        csv=f"{PLAN_OUT}/{{pmap}}/map.csv",
        figures=expand(
            f"{PLAN_OUT}/{{{{pmap}}}}/{{name}}.{{ext}}",
            name=PLAN_FIGURES,
            ext=("png", "pdf"),
        ),
    log:
        f"logs/{PLAN['name']}/{{pmap}}.log",
    conda:
        "../../env/environment.yml"
    params:
        python=PYTHON,
        config=PLAN_CONFIG,
        model=lambda wc: PLAN_MAPS[wc.pmap]["model"],
        hardware=lambda wc: PLAN_MAPS[wc.pmap]["hardware"],
        out=lambda wc, output: os.path.dirname(output.csv),
    shell:
        "{params.python:q} -m tspbench plan-map --config {params.config:q} --model {params.model:q}"
        " --hardware {params.hardware:q} --out {params.out:q} > {log:q} 2>&1"


rule plan_check:
    input:
        summaries=expand(
            f"{PLAN_REF}/calibration/default-summary-{{i}}.csv", i=(1, 2, 3)
        ),
        preset=f"{PLAN_REF}/calibration/cpu-2c.json",
        memory=f"{PLAN_REF}/projected-7b/memory.csv",
    output:
        f"{PLAN_OUT}/check.md",
    log:
        f"logs/{PLAN['name']}/check.log",
    conda:
        "../../env/environment.yml"
    params:
        python=PYTHON,
    shell:
        "{params.python:q} -m tspbench plan-check --summary {input.summaries:q}"
        " --hardware {input.preset:q} --memory {input.memory:q} --out {output:q} > {log:q} 2>&1"
