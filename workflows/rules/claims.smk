# The paper's claims against ours (`tspbench claims`): seconds, from this sweep's summary and the
# projected tables (fresh results/projected under the workdir, else the committed references:
# claims_projected). The claims file is the one packaged with tspbench.
from tspbench.core import datafiles


rule claims:
    input:
        summary=f"{OUT}/summary.csv",
        claims=str(datafiles.path("data/claims.yaml")),
    output:
        csv=report(
            f"{OUT}/claims.csv",
            caption="../report/claims.rst",
            category="Paper claims",
        ),
        md=f"{OUT}/claims.md",
    log:
        f"logs/{NAME}/claims.log",
    conda:
        "../../env/environment.yml"
    params:
        python=PYTHON,
        projected=lambda wc: claims_projected(),
    shell:
        "{params.python:q} -m tspbench claims --claims {input.claims:q}"
        " --measured {input.summary:q} --projected {params.projected:q}"
        " --out {output.csv:q} --md {output.md:q} > {log:q} 2>&1"
