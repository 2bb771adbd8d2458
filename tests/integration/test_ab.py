"""`tspbench regress-ab` run for real (the promise of issue 35): the baseline commit's code and
this code time the same cells on this machine, interleaved. The same code passes with a CPU hog
running beside it; a 20% slowdown of every cell fails the median over cells (the ``slower``
fault, which only the current code's runs see); a cell the current code cannot run fails. Two
cells each: every run is a real 2-rank process world (about 6 s). The baseline commit is this
clone's HEAD: in a clean clone (CI) A and B are the same code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runner import ROOT, tspbench

CELLS = """name: ab
model: tiny
model_overrides: {{ffn: 256}}
dtype: fp32
warmup: 2
steps: 8
seed: 0
recompute: none
timeout: 300
gpu: false
gpus_per_node: 2
launcher: local
sweeps:
  - name: ab
    strategies: [{strategies}]
    degrees: [2]
    gpus: [2]
    seq_lens: [1024]
    batches: [1]
    modes: [train]
"""


def ab(tmp_path: Path, strategies: str, fault: str = "", *more: str) -> subprocess.CompletedProcess:
    """regress-ab of ``strategies`` (one cell each) with the CI tolerances; HEAD as baseline."""
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    if head.returncode:
        pytest.skip("not a git clone: no baseline commit")
    commit = tmp_path / "ab.json"
    commit.write_text(json.dumps({"commit": head.stdout.strip()}))
    config = tmp_path / "cells.yaml"
    config.write_text(CELLS.format(strategies=strategies))
    return tspbench(
        "regress-ab",
        "--config",
        config,
        "--commit-file",
        commit,
        "--out",
        tmp_path / "ab.md",
        *more,
        cwd=ROOT,
        env={"TSPBENCH_FAULT": fault},
        timeout=900,
    )


def row(out: str, cell: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(f"| {cell} |"))


def test_the_same_code_passes_on_a_loaded_machine(tmp_path):
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        r = ab(tmp_path, "tsp, tp")
    finally:
        hog.kill()
        hog.wait()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 regression(s)" in r.stdout and (tmp_path / "ab.md").is_file()


def test_a_uniform_20_percent_slowdown_fails(tmp_path):
    """Every cell 20% slower: the median over cells fails, a uniform slowdown that no machine
    difference excuses here (one strategy's larger slowdown failing its own cell is checked on
    scripted runs in tests/unit/test_ab.py: two cells keep this real run short)."""
    # (15% once read 0.999 and 1.131 in CI at bf20cee, a median of 1.065: a cell's reading still
    # moves by 12-15% on this VM; 20% stays under the cells' +25% and clears the median's +8%)
    r = ab(tmp_path, "tp, sp", "slower:fraction=0.20")
    assert r.returncode == 1, r.stdout + r.stderr
    assert row(r.stdout, "(median over cells)").endswith("| regression |"), r.stdout


def test_a_cell_the_current_code_cannot_run_fails(tmp_path):
    """(The records kept under a relative --work: the runs start in their own trees.)"""
    r = ab(tmp_path, "tp", "error:step=3", "--work", os.path.relpath(tmp_path / "runs", ROOT))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "| tp.D2.g2.S1024.B1.train | | | | | failed (current code) |" in r.stdout
    assert (tmp_path / "runs/tp.D2.g2.S1024.B1.train.A0.json").is_file()
