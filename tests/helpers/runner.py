"""Subprocess plumbing the command-line, pipeline and reliability tests share: the repository
root, ``python -m tspbench`` and ``python -m snakemake``, each run to the end with its output
captured (the caller asserts on the return code and the text)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the project's tools live beside its interpreter, not on PATH


def tool(name: str) -> str:
    """The installed command ``name`` (torchrun, mpiexec, ...) beside the interpreter running
    the tests: found the same whether or not the virtual environment is activated."""
    path = BIN / name
    if not path.exists():
        raise FileNotFoundError(f"{path}: not installed (bash env/install.sh installs it)")
    return str(path)


def _env(env: dict[str, str] | None) -> dict[str, str] | None:
    return {**os.environ, **env} if env else None


def tspbench(
    *args: object,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    launcher: list[str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """``tspbench <args>`` (``launcher``: a command to start Python with, e.g. torchrun)."""
    cmd = [*(launcher or [sys.executable]), "-m", "tspbench", *map(str, args)]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=_env(env)
    )


def snakemake(
    *args: str, cwd: Path | str = ROOT, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "snakemake", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=_env(env),
    )


def copy_workflow(dst: Path) -> Path:
    """A scratch copy of the pipeline (Snakefile, rules, configs, profiles, env, and the committed
    references the claims rule falls back to under its workdir) in ``dst``, so a test's sweep
    writes its results there and not into the repository."""
    import shutil

    for item in ("Snakefile", "workflows", "env", "profiles", "results/reference", ".test/config"):
        src = ROOT / item
        (dst / item).parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst / item)
    return dst
