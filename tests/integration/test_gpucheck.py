"""``tspbench gpu-check`` (env/gpu-check.sh) on this CPU: every step runs, with only torch,
numpy and pyyaml importable besides the suite, and everything lands in one folder of at most 8
files, as a lent GPU machine sends back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_on_common_packages_only(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable,
           "PYTHONPATH": str(ROOT / "tests/helpers/common_only")}  # fmt: skip
    p = subprocess.run(["bash", str(ROOT / "env/gpu-check.sh"), str(out)], env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [s["name"] for s in summary["steps"]] == ["doctor", "run-tsp", "run-tp", "run-decode"]
    assert sum(s["timeout_s"] for s in summary["steps"]) <= 300
    assert all(s["rc"] == 0 for s in summary["steps"]), summary["steps"]
    assert all(r and r["status"] == "ok" for r in summary["records"].values())
    probed = [p for p in summary["rank_probe"] if p["status"] != "skipped"]
    assert probed and all(p["status"] == "ok" for p in probed)  # the doctor's, run whole
    skipped = [p["name"] for p in summary["rank_probe"] if p["status"] == "skipped"]
    # the reference, and a2a+p2p over TP+SP 4x2's Sigma = 2 (no inner group below 2)
    assert sorted(skipped) == [
        "rank probe single D=8",
        "rank probe tpsp (4x2) {'cp_comm': 'a2a+p2p'} D=8 (small)",
    ], skipped
    files = sorted(f.name for f in out.iterdir())
    assert len(files) <= 8 and all(f.is_file() for f in out.iterdir()), files
    log = (out / "log.txt").read_text()
    assert "No module named" not in log


def test_the_blocker_blocks(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests/helpers/common_only")}
    p = subprocess.run([sys.executable, "-c", "import pandas"], env=env, capture_output=True,
                       text=True)  # fmt: skip
    assert p.returncode != 0 and "No module named 'pandas'" in p.stderr


def test_the_validation_runs_and_the_kernel_timings_run_on_cpu(tmp_path):
    """env/gpu-validate.sh and env/gpu_kernels.py, the other two commands a lent GPU ran
    (results/reference/gpu-h200), on their CPU stand-ins: every run ok, every kernel timed."""
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(["bash", str(ROOT / "env/gpu-validate.sh"), str(tmp_path / "v")],
                       env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    records = [json.loads(f.read_text()) for f in (tmp_path / "v").glob("*.json")]
    assert len(records) == 3 and all(r["status"] == "ok" for r in records)
    out = tmp_path / "k.json"
    p = subprocess.run([sys.executable, str(ROOT / "env/gpu_kernels.py"), str(out),
                        "--part", "kernels"], env=env, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads(out.read_text())["kernels"]
    assert {r["kernel"] for r in rows} == {"cpu_flash", "sdpa"}
    assert all(r["fwd_bwd_s"] > 0 for r in rows)
