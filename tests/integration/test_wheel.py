"""The installed package is self-contained (issue 30): a wheel built from the sources, installed
into a folder of its own and run from a directory outside the repository, finds its schemas and
the paper's claims inside itself. The dev environment's editable install points at a checkout,
so the test checks that the wheel's copy is the one imported."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers.runner import ROOT

SOURCES = ("pyproject.toml", "README.md", "LICENSE", "tspbench", "tsp_impl", "baselines")
REFS = ROOT / "results/reference"


def _run(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120
    )


def _install(tmp: Path) -> Path:
    """The wheel, built offline from a copy of the sources (an in-tree build would leave build/
    in the checkout, and a stale build/lib would put removed files in the wheel)."""
    src = tmp / "src"
    src.mkdir()
    for item in SOURCES:
        path = ROOT / item
        if path.is_dir():
            shutil.copytree(path, src / item, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / item)
    pip = ("-m", "pip", "-q", "--disable-pip-version-check")
    p = _run(*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "--no-index",
             "-w", str(tmp / "dist"), cwd=tmp)  # fmt: skip
    assert p.returncode == 0, p.stderr
    (wheel,) = (tmp / "dist").glob("tspbench-*.whl")
    site = tmp / "site"
    p = _run(*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel), cwd=tmp)
    assert p.returncode == 0, p.stderr
    return site


def test_the_wheel_runs_claims_and_plan_outside_the_repository(tmp_path):
    site = _install(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    assert not work.resolve().is_relative_to(ROOT)
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = lambda *a: _run("-m", "tspbench", *a, cwd=work, env=env)

    where = "import tspbench, tsp_impl, baselines as b; print(tspbench.__file__, b.__file__)"
    p = _run("-c", where, cwd=work, env=env)
    assert p.returncode == 0, p.stderr
    assert all(Path(f).is_relative_to(site) for f in p.stdout.split()), p.stdout

    # no results here: one line saying where the defaults were looked for, and what to give
    p = run("claims")
    assert p.returncode == 2 and "give --measured and --projected" in p.stderr, p.stderr
    p = run("claims", "--projected", str(REFS / "projected-7b"), "--out", "c.csv",
            "--measured", str(REFS / "calibration/default-summary-1.csv"))  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "The paper's claims against ours" in p.stdout and (work / "c.csv").is_file()

    p = run("plan", "--model", "7b", "--hardware", "h100", "--seq-len", "131072", "--gpus", "8",
            "--no-cache")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "pipeline config" in p.stdout  # its models come from the packaged sweep schema
    p = run("check-config", str(ROOT / "workflows/config/ci.yaml"))
    assert p.returncode == 0 and "valid" in p.stdout, p.stderr
    assert not (work / "results").exists() and sorted(os.listdir(work)) == ["c.csv"]
