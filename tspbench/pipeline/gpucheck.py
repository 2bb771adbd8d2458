"""``tspbench gpu-check``: everything one GPU can tell about the suite, in one folder, in minutes.

For a lent or borrowed machine with one GPU and no network, on the machine's own torch (no
install: ``env/gpu-check.sh`` puts the checkout on PYTHONPATH). Each step is a subprocess with
its own time limit, so one crash or hang costs that step only: the versions, ``tspbench
doctor`` (kernels, every strategy against the reference, measured peak against the estimate, a
calibrated preset, and the rank probe: one rank of a D = 8 cell of every strategy on the fake
process group against its estimate), then three short real runs (TSP and TP training, TSP
decode). The limits add up to 5 minutes.
What it writes (at most 8 files, one folder): ``summary.json`` (every step's command, exit code,
seconds and output tail), ``log.txt`` (every step's whole output), ``doctor.json``,
the three run records and the calibrated preset when the doctor makes one.
It imports nothing beyond torch, numpy and pyyaml (``tests/integration/test_gpucheck.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tspbench.runtime.record import versions, write_json

# the three real runs, on one GPU (bf16, 4 layers of the 7B at 16K; decode over an 8K prompt)
# and their CPU stand-ins (fp32, tiny), so the command is checked where no GPU is
RUNS = {
    "run-tsp": ["--strategy", "tsp", "--mode", "train"],
    "run-tp": ["--strategy", "tp", "--mode", "train"],
    "run-decode": ["--strategy", "tsp", "--mode", "decode", "--new-tokens", "16"],
}
SHAPES = {
    "cuda": ["--model", "7b", "--set", "layers=4", "--dtype", "bf16"],
    "cpu": ["--model", "tiny", "--dtype", "fp32"],
}
LENGTH = {"cuda": {"train": 16384, "decode": 8192}, "cpu": {"train": 256, "decode": 128}}


@dataclass
class Step:
    name: str
    argv: list[str]
    timeout_s: float


def steps(out: Path, device: str) -> list[Step]:
    """The check's commands, in order, with their time limits (seconds)."""
    py = [sys.executable, "-m", "tspbench"]
    plan = [Step("doctor", [*py, "doctor", "--out", str(out)], 180)]  # the rank probe too
    for name, args in RUNS.items():
        mode = "decode" if "decode" in args else "train"
        length = ["--prompt-len" if mode == "decode" else "--seq-len", str(LENGTH[device][mode])]
        argv = [*py, "run", *args, *SHAPES[device], *length, "--degree", "1", "--warmup", "1"]
        argv += ["--recompute", "full"] if device == "cuda" and mode == "train" else []
        argv += ["--steps", "2", "--device", device, "--quiet", "--out", str(out / f"{name}.json")]
        plan.append(Step(name, argv, 40))
    return plan


def _gpu_facts() -> dict:
    """What the driver says (nvidia-smi or rocm-smi), when it is there."""
    for tool in (["nvidia-smi", "-q"], ["rocm-smi", "--showallinfo"]):
        try:
            p = subprocess.run(tool, capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            continue
        return {"tool": tool[0], "rc": p.returncode, "text": p.stdout[-6000:]}
    return {"tool": None}


def gpu_check(out: Path, device: str | None = None) -> int:
    """Run every step into ``out``; the number of steps that failed (0: all ran clean)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else None
    summary: dict = {"device": device, "gpu": gpu, "versions": versions(None)}
    summary |= {"driver": _gpu_facts(), "steps": []}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(out / "log.txt", "w") as log:
        for step in steps(out, device):
            t0 = time.monotonic()
            log.write(f"== {step.name}: {' '.join(step.argv)}\n")
            log.flush()
            try:
                p = subprocess.run(step.argv, capture_output=True, text=True, env=env,
                                   timeout=step.timeout_s)  # fmt: skip
                rc, text = p.returncode, p.stdout + p.stderr
            except subprocess.TimeoutExpired as e:  # its output is bytes, even with text=True
                got = [x.decode(errors="replace") if isinstance(x, bytes) else x
                       for x in (e.stdout, e.stderr) if x]  # fmt: skip
                rc, text = 124, "".join(got) + f"\ntimed out after {step.timeout_s:g} s"
            seconds = time.monotonic() - t0
            log.write(f"{text}\n-- rc {rc}, {seconds:.1f} s\n")
            log.flush()
            row = {"name": step.name, "argv": step.argv, "rc": rc, "timeout_s": step.timeout_s,
                   "seconds": round(seconds, 1)}  # fmt: skip
            summary["steps"].append({**row, "tail": text[-1500:]})
            print(f"{'ok' if rc == 0 else 'FAILED':8s} {step.name} ({seconds:.1f} s)", flush=True)
    summary["seconds"] = round(time.monotonic() - started, 1)
    summary["records"] = {s: _record(out / f"{s}.json") for s in RUNS}
    summary["rank_probe"] = _probe(out / "doctor.json")
    write_json(out / "summary.json", summary)
    failed = [s["name"] for s in summary["steps"] if s["rc"] != 0]
    print(f"gpu-check: {len(summary['steps']) - len(failed)} ok, {len(failed)} failed in "
          f"{summary['seconds']:.0f} s; wrote {out}")  # fmt: skip
    return len(failed)


def _record(path: Path) -> dict | None:
    """The headline numbers of one run record (None when the run wrote none)."""
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    keys = ("status", "error_message", "peak_mem_bytes", "step_time_s", "tokens_per_s", "mfu",
            "startup_s", "wall_s", "attention_backend")  # fmt: skip
    return {k: rec.get(k) for k in keys if k in rec}


def _probe(path: Path) -> list | None:
    """The doctor's rank-probe lines: measured against estimated peak per strategy."""
    try:
        return json.loads(path.read_text()).get("rank_probe")
    except (OSError, ValueError, AttributeError):
        return None
