# The regression check of the exact metrics and tracked memory: this sweep's table against its
# committed baseline (results/baselines/<sweep name>.csv: the same on every machine). Timings are
# judged A/B by `tspbench regress-ab`, which .ci/run runs after it (docs/pipeline.md).
#   snakemake --cores 2 --configfile workflows/config/ci.yaml regress


rule regress:
    input:
        f"{OUT}/summary.csv",
    output:
        f"{OUT}/regress.md",
    log:
        f"logs/{NAME}/regress.log",
    conda:
        "../../env/environment.yml"
    params:
        python=PYTHON,
        baseline=lambda wc: f"{config.get('baseline', 'results/baselines')}/{NAME}.csv",
    shell:
        "{params.python:q} -m tspbench regress --baseline {params.baseline:q} --current {input:q}"
        " --tolerances workflows/regress.yaml --out {output:q} 2>&1 | tee {log:q}"
