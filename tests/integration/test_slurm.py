"""The pipeline through a real Slurm (one node on this machine) with the repository's Slurm profile.

Needs the daemons of env/slurm/start.sh (.ci/run starts them); skipped, saying so, where no
Slurm answers. Cells are submitted by snakemake-executor-plugin-slurm with sbatch, their ranks
started by srun (one task per rank), and `tspbench run --launch env` takes rank, world and master
from Slurm's variables. One cell stalls on purpose under a one-minute runtime: it must stop
itself before Slurm kills it, be recorded as failed with the reason, and not stop the sweep.
Settings only this one-node test needs (status via squeue since accounting is off, no account,
a short first status check) are passed here, not put in the users' profile.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pandas as pd
import pytest
import yaml

from tests.helpers.runner import ROOT, copy_workflow

pytestmark = pytest.mark.slurm


def slurm_up() -> bool:
    try:
        p = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return p.returncode == 0 and any(s in p.stdout for s in ("idle", "mixed", "alloc"))


CONFIG = {
    "name": "slurmtest",
    "model": "tiny",
    "dtype": "fp32",
    "warmup": 0,
    "steps": 1,
    "gpus_per_node": 4,
    "launcher": "local",  # the Slurm profile switches this to srun
    "timeout": 600,
    "runtime_minutes": 1,
    "sweeps": [
        {
            "name": "seq",
            "strategies": ["tsp", "tp"],
            "degrees": [2],
            "gpus": [2],
            "seq_lens": [64],
            "batches": [1],
            "modes": ["train"],
        },
        {
            "name": "four",
            "strategies": ["tsp"],
            "degrees": [4],
            "gpus": [4],
            "seq_lens": [64, 128],
            "batches": [1],
            "modes": ["train"],
        },
    ],
}
STALLED = "tsp.D4.g4.S128.B1.train"


@pytest.mark.skipif(not slurm_up(), reason="no Slurm answers here (bash env/slurm/start.sh)")
def test_sweep_through_real_slurm(tmp_path, report):
    copy_workflow(tmp_path)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(CONFIG))
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "--profile",
        str(ROOT / "workflows/profiles/slurm"),
        "--configfile",
        "cfg.yaml",
        "--slurm-status-command",
        "squeue",
        "--slurm-no-account",
        "--slurm-init-seconds-before-status-checks",
        "5",
        "--verbose",
    ]
    t0 = time.monotonic()
    p = subprocess.run(
        cmd,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1200,
        env={**__import__("os").environ, "TSPBENCH_FAULT": "stall:rank=0:step=0:seq_len=128"},
    )
    took = time.monotonic() - t0
    log = p.stdout + p.stderr
    (tmp_path / "snakemake.out").write_text(log)
    assert p.returncode == 0, log[-4000:]
    sbatch = sorted(set(re.findall(r"(sbatch call: .*)", log)))
    shown = [next(x for x in sbatch if f"--ntasks-per-node={n}" in x) for n in (2, 4)]
    report(
        "Slurm test",
        f"took {took:.0f} s; {len(sbatch)} sbatch calls; a 2- and a 4-rank cell's:\n"
        + "\n".join(x.split(" --wrap=")[0] for x in shown),
    )
    assert len(sbatch) == 4  # one per cell (table rules are localrules)
    df = pd.read_csv(tmp_path / "results/slurmtest/summary.csv").set_index("cell")
    assert (df["status"] == "ok").sum() == 3
    assert df.loc[STALLED, "status"] == "error"
    assert "time limit" in df.loc[STALLED, "error_message"]
    for cell in df.index.drop(STALLED):
        rec = json.loads((tmp_path / f"results/slurmtest/runs/{cell}.json").read_text())
        assert rec["launcher"] == "slurm" and rec["world_size"] in (2, 4)
    # the same columns as a local run's table (test_pipeline's mini sweep makes the same table)
    local_cols = set(pd.read_csv(tmp_path / "results/slurmtest/summary.csv").columns)
    from tspbench.pipeline.aggregate import SCALARS

    assert set(SCALARS) - {"error_message"} <= local_cols
    assert any("--ntasks-per-node=4" in s for s in sbatch)
    assert any("--ntasks-per-node=2" in s for s in sbatch)
