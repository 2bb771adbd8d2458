# One job per cell: `tspbench run` writes the cell's record. An OOM or a failed run is a result
# (a record with status oom/error), so the job succeeds whenever a record was written.


rule run:
    output:
        f"{OUT}/runs/{{cell}}.json",
    log:
        f"logs/{NAME}/run/{{cell}}.log",
    retries: 1
    conda:
        "../../env/environment.yml"
    threads: run_threads
    resources:
        nodes=cell_resource("nodes"),
        tasks_per_node=cell_resource("tasks_per_node"),
        gres=cell_resource("gres"),
        tasks_per_gpu=0,
        mpi=cell_resource("mpi"),
        runtime=runtime,
    params:
        cmd=lambda wc: command(cell_of(wc), config, PYTHON),
        # stop (and record why) before the scheduler's runtime runs out
        limit=lambda wc, resources: max(30, resources.runtime * 60 - 30),
    shell:
        "{params.cmd} --out {output} --time-limit {params.limit} > {log} 2>&1 || true;"
        " test -s {output}"
