# The regression check: this sweep's table against the committed baseline of this hardware.
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
        baseline=lambda wc: f"{config.get('baseline', 'results/baselines')}/{hardware_id()}.csv",
    shell:
        "{params.python:q} -m tspbench regress --baseline {params.baseline:q} --current {input:q}"
        " --tolerances workflows/regress.yaml --out {output:q} 2>&1 | tee {log:q}"
