"""Reliability: bad input is refused with exit 2 and a message naming the field (nothing
written), a killed or stalled rank cannot hang the others, signals leave a record, a sweep with a
failing and an OOM cell still finishes and says so, and the same seed gives the same loss."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tests.helpers.runner import ROOT, snakemake, tspbench

RUN = ["run", "--strategy", "tsp", "--seq-len", "32"]
OK_CONFIG = yaml.safe_load((ROOT / "workflows/config/default.yaml").read_text())


def cfg_with(**top) -> str:
    return yaml.safe_dump({**OK_CONFIG, **top})


def sweep_with(**kw) -> str:
    c = json.loads(json.dumps(OK_CONFIG))
    c["sweeps"][0].update(kw)
    return yaml.safe_dump(c)


# (kind, args or file text, environment, expected message)


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its SigCgt mask)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(x for x in status.splitlines() if x.startswith("SigCgt:")).split()[1], 16)
    return bool(mask >> (sig - 1) & 1)


def leftovers(marker: str) -> list[str]:
    """Processes whose command line names ``marker`` (full width: pytest sets COLUMNS, and a
    truncated line would hide a leftover rank)."""
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if marker in line and "ps -ww" not in line]


FAULT_RUN = [
    "run",
    "--strategy",
    "tsp",
    "--degree",
    "4",
    "--seq-len",
    "64",
    "--steps",
    "3",
    "--launch",
    "local",
    "--quiet",
]
TIMEOUT = 10


@pytest.fixture(scope="module")
def baseline_s(tmp_path_factory) -> float:
    """Wall time of the same run without a fault (start-up dominates on 2 cores)."""
    out = tmp_path_factory.mktemp("base") / "ok.json"
    t0 = time.monotonic()
    p = tspbench(*FAULT_RUN, "--out", str(out), "--timeout", str(TIMEOUT))
    assert p.returncode == 0, p.stderr[-2000:]
    return time.monotonic() - t0


@pytest.mark.parametrize(
    "fault, needle",
    [
        ("kill:rank=2:step=2", "rank 2 killed by SIGKILL"),
        ("kill:rank=0:step=1", "rank 0 killed by SIGKILL"),
        ("stall:rank=1:step=1", "no progress for"),
        ("error:rank=3:step=1", "injected fault"),
    ],
)
def test_a_dead_or_stalled_rank_ends_every_rank(tmp_path, baseline_s, fault, needle):
    out = tmp_path / "f.json"
    t0 = time.monotonic()
    p = tspbench(
        *FAULT_RUN, "--out", str(out), "--timeout", str(TIMEOUT), env={"TSPBENCH_FAULT": fault}
    )
    took = time.monotonic() - t0
    rec = json.loads(out.read_text())
    assert p.returncode == 1 and rec["status"] == "error", rec
    assert needle in rec["error_message"], rec["error_message"]
    assert took < baseline_s + TIMEOUT + 10, (took, baseline_s)
    assert leftovers(str(out)) == []


@pytest.mark.parametrize(
    "sig, when",
    [
        (signal.SIGTERM, "launcher"),  # the launcher is importing torch, no rank started
        (signal.SIGTERM, "import"),  # ranks still importing torch: no guard yet
        (signal.SIGINT, "import"),
        (signal.SIGTERM, "run"),  # a rank stalls mid-run, the rest wait in a collective
    ],
)
def test_a_signal_at_any_moment_leaves_a_record_saying_so(tmp_path, sig, when):
    """A SIGTERM/SIGINT to the launcher, from its first instant to the middle of the run, ends
    every rank and leaves a record that names the signal (the launcher exits 128 + signal)."""
    out = tmp_path / "t.json"
    cmd = [sys.executable, "-m", "tspbench", *FAULT_RUN, "--out", str(out), "--timeout", "60"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TSPBENCH_FAULT": "stall:rank=1:step=1"},
    )
    procs = {"launcher": 1, "import": 2, "run": 5}[when]  # the launcher, then its ranks
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(leftovers(str(out))) < procs:
        time.sleep(0.05)
    while when == "launcher" and time.monotonic() < deadline and not catches(proc.pid, sig):
        time.sleep(0.01)  # from tspbench's first line on (before it: the interpreter's start)
    if when == "run":
        time.sleep(4)
    proc.send_signal(sig)
    code = proc.wait(timeout=60)
    rec = json.loads(out.read_text())
    name = signal.Signals(sig).name
    assert rec["status"] == "error" and f"interrupted by {name}" in rec["error_message"], rec
    assert code == 128 + sig, (code, proc.stderr.read()[-2000:])
    assert leftovers(str(out)) == []


def test_same_seed_same_loss_bitwise(tmp_path):
    recs = []
    for i in range(2):
        out = tmp_path / f"d{i}.json"
        p = tspbench(
            "run",
            "--strategy",
            "tsp",
            "--degree",
            "2",
            "--seq-len",
            "64",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--launch",
            "local",
            "--quiet",
            "--out",
            str(out),
        )
        assert p.returncode == 0, p.stderr[-2000:]
        recs.append(json.loads(out.read_text()))
    assert recs[0]["loss"] == recs[1]["loss"] and recs[0]["grad_norm"] == recs[1]["grad_norm"]


def test_sweep_with_a_failing_and_an_oom_cell_finishes_and_marks_both(tmp_path):
    import shutil

    for item in ("Snakefile", "workflows", "env"):
        src = ROOT / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / item)
    cfg = {
        "name": "faulty",
        "model": "tiny",
        "dtype": "fp32",
        "warmup": 0,
        "steps": 1,
        "gpus_per_node": 2,
        "launcher": "local",
        "sweeps": [
            {
                "name": "seq",
                "strategies": ["tsp", "tp"],
                "degrees": [2],
                "gpus": [2],
                "seq_lens": [32, 64],
                "batches": [1],
                "modes": ["train"],
            }
        ],
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    faults = "error:rank=1:seq_len=64:strategy=tsp,oom:rank=0:seq_len=64:strategy=tp"
    p = snakemake(
        "--cores", "2", "--configfile", "cfg.yaml", cwd=tmp_path, timeout=900,
        env={"TSPBENCH_FAULT": faults},
    )  # fmt: skip
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    df = pd.read_csv(tmp_path / "results/faulty/summary.csv").set_index("cell")
    assert df.loc["tsp.D2.g2.S64.B1.train", "status"] == "error"
    assert df.loc["tp.D2.g2.S64.B1.train", "status"] == "oom"
    assert (df["status"] == "ok").sum() == 2
    table = (tmp_path / "results/faulty/tables/md/memory_vs_seq.md").read_text()
    assert "OOM" in table and "failed" in table
    failures = (tmp_path / "results/faulty/tables/failures.md").read_text()
    assert "injected fault" in failures and "injected out of memory" in failures
    assert (tmp_path / "plots/faulty/png/memory_vs_seq.png").exists()
