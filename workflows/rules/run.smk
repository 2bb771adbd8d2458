# One job per cell: `tspbench run --cell` writes the cell's record. An OOM or a failed run is a
# result (a record with status oom/error), so the job succeeds whenever a record was written; a
# run interrupted by a signal leaves no record there, so the next run of the pipeline redoes it.


rule run:
    output:
        f"{OUT}/runs/{{cell}}.json",
    log:
        f"logs/{NAME}/run/{{cell}}.log",
    retries: config["retries"]
    conda:
        "../../env/environment.yml"
    threads: run_threads
    resources:
        nodes=cell_resource("nodes"),
        tasks_per_node=cell_resource("tasks_per_node"),
        gres=cell_resource("gres"),
        tasks_per_gpu=0,
        mpi=cell_resource("mpi"),
        cpus_per_task=cell_resource("cpus_per_task"),
        mem_mb=cell_resource("mem_mb"),
        slurm_extra=cell_resource("slurm_extra"),
        runtime=runtime,
    params:
        line=run_line,
    shell:
        "{params.line}"


# One sweep's cells alone, a named target: `snakemake --profile slurm --configfile
# workflows/config/paper.yaml results/paper/sweeps/degree.txt` runs the degree sweep's cells
# (cells several sweeps share run once) and lists their records; the sweep names are the
# config's, so another name matches no rule.
rule sweep:
    input:
        lambda wc: expand(
            f"{OUT}/runs/{{cell}}.json",
            cell=[c.id for c in CELLS_LIST if wc.sweep in c.sweeps],
        ),
    output:
        f"{OUT}/sweeps/{{sweep}}.txt",
    log:
        f"logs/{NAME}/sweeps/{{sweep}}.log",
    wildcard_constraints:
        sweep="|".join(sorted({re.escape(s["name"]) for s in config["sweeps"]})),
    run:
        # (no shell line: nothing of a path reaches a shell)
        Path(output[0]).write_text("".join(f"{path}\n" for path in input))
