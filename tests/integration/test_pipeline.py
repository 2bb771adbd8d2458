"""The Snakemake pipeline: config validation, Slurm resources in a dry run, a real mini sweep
that resumes only its missing cells, and tables/figures that mark failed cells."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tests.helpers.configs import MINI
from tests.helpers.runner import ROOT, copy_workflow
from tests.helpers.runner import snakemake as smk

README = ROOT / "README.md"


def test_paper_dry_run_on_the_slurm_profile_has_the_right_resources(tmp_path):
    paper = yaml.safe_load((ROOT / "workflows/config/paper.yaml").read_text())
    cfg = tmp_path / "paper.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                **paper,
                "node_resources": "config",
                "exclusive": True,
                "cpus_per_task": 4,
                "mem_mb": 500000,
            }
        )  # fmt: skip
    )
    p = smk("-n", "-p", "--profile", "workflows/profiles/slurm", "--configfile", str(cfg))
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout + p.stderr

    def resources(cell: str) -> dict:
        block = out[out.index(f"cell={cell}\n") :]
        line = re.search(r"resources: (.*)", block).group(1)
        return dict(kv.split("=", 1) for kv in line.split(", "))

    big = resources("tsp.D8.g1024.S131072.B1.infer")
    assert (big["nodes"], big["tasks_per_node"], big["gres"]) == ("128", "8", "gpu:8")
    assert (big["mpi"], big["tasks_per_gpu"]) == ("srun", "0")
    small = resources("tpsp-2x4.D8.g8.S16384.B1.train")
    assert (small["nodes"], small["tasks_per_node"], small["gres"]) == ("1", "8", "gpu:8")
    assert int(big["runtime"]) == 8 * int(small["runtime"]) // 4  # with S; infer: a quarter
    assert (small["cpus_per_task"], small["mem_mb"], small["slurm_extra"]) == (
        "4",
        "500000",
        "--exclusive",
    )
    sruns = re.findall(r"Shell command: (srun .*)", out)
    assert sruns and all("--kill-on-bad-exit=1" in s and "--device cuda" in s for s in sruns)
    assert all("--cpus-per-task=4" in s for s in sruns)


def test_the_gpu_node_config_reserves_what_the_readme_says():
    """The evaluator's one-node config: the Slurm runtimes of its cells, times their GPUs, sum
    to the README's GPU-hours, every cell's runtime covers its start-up allowance, and no cell is
    retried (a retry would reserve its runtime again, twice over)."""
    cfg = ROOT / "workflows/config/gpu-node.yaml"
    config = yaml.safe_load(cfg.read_text())
    assert config["retries"] == 0
    p = smk("-n", "-p", "--profile", "workflows/profiles/slurm", "--configfile", str(cfg))
    assert p.returncode == 0, p.stderr[-3000:]
    jobs = re.findall(r"resources: (.*)", p.stdout + p.stderr)
    cells = [dict(kv.split("=", 1) for kv in j.split(", ")) for j in jobs if "gres=gpu" in j]
    assert len(cells) == 32
    assert all(int(c["runtime"]) * 60 > config["startup_s"] for c in cells)
    hours = sum(
        int(c["runtime"]) / 60 * int(c["nodes"]) * int(c["gres"].split(":")[1]) for c in cells
    )
    row = re.search(r"gpu-node.yaml` \(one node.*?\| 32 \| ([0-9.]+) \|", README.read_text())
    assert row and hours == pytest.approx(float(row[1]), abs=0.05), hours


def test_one_sweep_is_a_named_target(tmp_path):
    """Issue 36: one sweep of a config ran through `--config 'sweeps=...'`. Now its own target:
    `results/<name>/sweeps/<sweep>.txt` schedules exactly that sweep's cells (those it shares
    with other sweeps included) and lists their records; a name the config lacks matches no
    rule. (The target goes before --configfile, which takes several files.)"""
    from tspbench.pipeline.cells import sweep_cells

    cfg = ROOT / "workflows/config/paper.yaml"
    cells, _ = sweep_cells(yaml.safe_load(cfg.read_text()))
    want = sorted(c.id for c in cells if "degree" in c.sweeps)
    p = smk("results/paper/sweeps/degree.txt", "-n", "--profile", "workflows/profiles/slurm",
            "--configfile", str(cfg))  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout + p.stderr
    assert sorted(set(re.findall(r"wildcards: cell=(\S+)", out))) == want and len(want) == 24
    assert re.search(r"^sweep\s+1$", out, re.M), out[-2000:]
    p = smk("results/paper/sweeps/nosuch.txt", "-n", "--configfile", str(cfg))
    assert p.returncode != 0 and "No rule to produce" in p.stdout + p.stderr


def test_a_gpu_sweep_with_a_cpu_only_torch_stops_before_any_cell(tmp_path):
    """gpu: true on a torch built without CUDA/ROCm (e.g. the CUDA wheel's CPU twin) would run
    every cell on the CPU with gloo: the pipeline stops first, naming why; a dry run still
    lists the jobs (a login node may have no GPU build)."""
    import torch

    if torch.version.cuda or torch.version.hip:
        pytest.skip("this torch has a GPU build")
    copy_workflow(tmp_path)
    cfg = {**MINI, "name": "g", "gpu": True}
    (tmp_path / "g.yaml").write_text(yaml.safe_dump(cfg))
    assert smk("-n", "--cores", "2", "--configfile", "g.yaml", cwd=tmp_path).returncode == 0
    p = smk("--cores", "2", "--configfile", "g.yaml", cwd=tmp_path)
    assert p.returncode != 0 and "built without CUDA or ROCm" in p.stdout + p.stderr
    # nothing of the sweep's (results/reference: the committed references copy_workflow brings)
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["reference"]
    assert not (tmp_path / "logs").exists()


def _write(tmp_path: Path, cfg: dict) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _base() -> dict:
    return yaml.safe_load((ROOT / "workflows/config/default.yaml").read_text())


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda c: c["sweeps"][0]["strategies"].append("zero"), "'zero' is not one of"),
        (
            lambda c: c["sweeps"][0].update(seq_lens=[1001]),
            "sweeps[0].seq_lens: 1001 must be divisible by 2*D = 8",
        ),
        (
            lambda c: c["sweeps"][0].update(gpus=[6]),
            "sweeps[0].gpus: 6 must be a multiple of the model group D = 4",
        ),
        (lambda c: c["sweeps"][0].update(tpsp=[[4, 2]]), "sweeps[0].tpsp: [4, 2] has T x Sigma"),
        (lambda c: c.update(steps=0), "0 is less than the minimum of 1"),
        (lambda c: c.update(model="13b"), "'13b' is not one of"),
        (lambda c: c.update(name="x; rm -rf /"), "does not match"),
    ],
)
def test_bad_config_stops_the_dry_run_naming_the_field(tmp_path, change, needle):
    cfg = _base()
    change(cfg)
    p = smk("-n", "--cores", "1", "--configfile", str(_write(tmp_path, cfg)))
    assert p.returncode != 0
    assert needle in p.stdout + p.stderr, (p.stdout + p.stderr)[-2000:]


def _in_test_dir(mini: Path, *args: str):
    """snakemake as the workflow catalog's CI runs it: from the root, in .test/ (``mini``)."""
    return smk(*args, "--directory", ".test", cwd=mini.parent, timeout=900)


@pytest.fixture(scope="module")
def mini(tmp_path_factory) -> Path:
    """The catalog's test config (.test/config/config.yaml, a mini sweep of 4 cells) run for
    real in a scratch copy of the workflow by the catalog's command; its folder, .test/."""
    work = tmp_path_factory.mktemp("wf")
    copy_workflow(work)
    p = _in_test_dir(work / ".test", "--cores", "2")
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return work / ".test"


def test_mini_sweep_produces_table_tables_and_figures(mini):
    df = pd.read_csv(mini / "results/mini/summary.csv")
    assert len(df) == 4 and set(df["status"]) == {"ok"}
    for col in (
        "strategy",
        "seq_len",
        "degree",
        "tp",
        "sp",
        "dp",
        "world_size",
        "mode",
        "batch",
        "dtype",
        "status",
        "peak_mem_bytes",
        "step_time_s",
        "tokens_per_s",
        "comm_bytes_total",
        "comm_bytes_broadcast",
        "comm_bytes_all_reduce",
        "flops_per_step",
        "loss",
        "grad_norm",
    ):
        assert col in df.columns, col
    assert (mini / "results/mini/summary.parquet").exists()
    assert (mini / "results/mini/tables/md/memory_vs_seq.md").exists()
    assert (mini / "results/mini/tables/tex/memory_vs_seq.tex").exists()
    assert (mini / "plots/mini/png/memory_vs_seq.png").exists()
    assert (mini / "plots/mini/pdf/memory_vs_seq.pdf").exists()


def test_every_file_the_sweep_writes_is_a_declared_output(mini):
    """Issue 36: the tables' LaTeX and the figures' PDF are outputs too (snakemake deletes and
    remakes only what it knows of): every file under the sweep's results and plots is a declared
    output or lies in a declared output folder (``--summary`` lists them)."""
    p = _in_test_dir(mini, "--summary")
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
    declared = {line.split("\t")[0] for line in p.stdout.splitlines()[1:] if "\t" in line}
    assert {"results/mini/tables/tex", "plots/mini/pdf"} <= declared
    written = [
        f.relative_to(mini).as_posix()
        for top in ("results/mini", "plots/mini")
        for f in (mini / top).rglob("*")
        if f.is_file()
    ]
    undeclared = [f for f in written if not any(f == d or f.startswith(d + "/") for d in declared)]
    assert written and undeclared == [], undeclared


def test_rerun_redoes_only_missing_cells(mini):
    """The state an interruption leaves: some records written, the rest and the aggregate not."""
    (mini / "results/mini/runs/tp.D2.g2.S64.B1.train.json").unlink()
    for p in ("results/mini/summary.csv", "results/mini/summary.parquet"):
        (mini / p).unlink()
    p = _in_test_dir(mini, "-n", "--cores", "2")
    assert p.returncode == 0
    jobs = re.findall(r"rule run:\n.*?wildcards: cell=(\S+)", p.stdout + p.stderr, re.S)
    assert jobs == ["tp.D2.g2.S64.B1.train"]
