# Records -> one tidy table -> tables (Markdown, LaTeX, HTML) and figures (PNG, PDF) for the
# report. The report shows the HTML tables and PNG figures themselves; its labels name the
# hardware the records ran on (read from the summary when the report is made).
from tspbench.pipeline.tables import report_labels


rule aggregate:
    input:
        expand(f"{OUT}/runs/{{cell}}.json", cell=CELLS),
    output:
        csv=report(
            f"{OUT}/summary.csv", caption="../report/summary.rst", category="Data"
        ),
        parquet=f"{OUT}/summary.parquet",
        filtered=f"{OUT}/filtered.csv",
    log:
        f"logs/{NAME}/aggregate.log",
    conda:
        "../../env/environment.yml"
    params:
        python=PYTHON,
        runs=lambda wc, input: os.path.dirname(input[0]),
        config=lambda wc: json.dumps(config),
    shell:
        "{params.python:q} -m tspbench aggregate --config-json {params.config:q}"
        " --runs {params.runs:q} --csv {output.csv:q} --parquet {output.parquet:q}"
        " --filtered {output.filtered:q} > {log:q} 2>&1"


rule tables:
    input:
        f"{OUT}/summary.csv",
    output:
        failures=f"{OUT}/tables/failures.md",
        failures_html=report(
            f"{OUT}/tables/failures.html",
            caption="../report/failures.rst",
            category="Tables",
            labels={"table": "failures"},
        ),
        tables=directory(f"{OUT}/tables/md"),
        tex=directory(f"{OUT}/tables/tex"),
        html=report(
            directory(f"{OUT}/tables/html"),
            patterns=["{name}.html"],
            caption="../report/tables.rst",
            category="Tables",
            labels=lambda wc, input: report_labels(input[0], "table", wc.name),
        ),
    log:
        f"logs/{NAME}/tables.log",
    conda:
        "../../env/environment.yml"
    params:
        python=PYTHON,
        out=lambda wc, output: os.path.dirname(output.failures),
        note=config.get("note", ""),
    shell:
        "{params.python:q} -m tspbench tables --summary {input:q} --out {params.out:q}"
        " --note={params.note:q} > {log:q} 2>&1"


rule figures:
    input:
        f"{OUT}/summary.csv",
    output:
        figures=report(
            directory(f"{PLOTS}/png"),
            patterns=["{name}.png"],
            caption="../report/figures.rst",
            category="Figures",
            labels=lambda wc, input: report_labels(input[0], "figure", wc.name),
        ),
        pdf=directory(f"{PLOTS}/pdf"),
    log:
        f"logs/{NAME}/figures.log",
    conda:
        "../../env/environment.yml"
    params:
        python=PYTHON,
        out=lambda wc, output: os.path.dirname(output.figures),
        note=config.get("note", ""),
    shell:
        "{params.python:q} -m tspbench figures --summary {input:q} --out {params.out:q}"
        " --note={params.note:q} > {log:q} 2>&1"
