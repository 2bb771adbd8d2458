"""The A/B timing check: the baseline commit's code (A) and the current code (B) time the same
cells on this machine, interleaved, and only their ratio is judged.

A timing compared with a table recorded on another machine moves with the machine (another CPU
model under one hardware id, a busy neighbour); a ratio measured in one run does not: both sides
share the machine and its load. The cells run round by round, side by side (A then B, then B
then A: the order alternates, as ``asv continuous`` does, so a drift in load hits both sides
alike); a cell's slowdown is the median over rounds of B/A (the project's rule: timings as
medians of ratios measured in one run). A cell fails beyond ``cell_tolerance``, and the median
over all cells, a uniform slowdown, beyond ``median_tolerance`` (the ``ab`` section of the
tolerances). The baseline code is the commit named in ``results/baselines/ab.json``, its packages
extracted with ``git archive`` (nothing is left in the clone's ``.git``). Exit codes as for
``regress``: 0 clean, 1 a regression or a cell the current code cannot run, 2 unusable input
(among it a baseline commit absent from the clone, or one that cannot run a cell).
"""

from __future__ import annotations

import io
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tspbench.core.config import ConfigError, read_input
from tspbench.pipeline.cells import Cell, run_args, sweep_cells

PACKAGES = ("tspbench", "tsp_impl", "baselines")  # the code a run imports (pyproject's packages)
COMMIT_FILE = Path("results/baselines/ab.json")


@dataclass(frozen=True)
class Side:
    """One code tree: its name in the report, the folder it imports from, its environment."""

    name: str
    tree: Path
    env: dict[str, str]


@dataclass
class CellRatio:
    cell: str
    ratios: list[float]  # B/A per round, for the metric's worse direction: above 1 is slower
    verdict: str = "ok"  # ok|regression

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)


def git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, timeout=120)


def read_commit(path: Path) -> str:
    """The baseline commit named in ``path`` (one line, exit 2, if absent or malformed)."""
    try:
        data = json.loads(read_input(path, "--commit-file"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"--commit-file={str(path)!r}: not JSON ({e})") from None
    commit = data.get("commit") if isinstance(data, dict) else None
    if not isinstance(commit, str) or not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise ConfigError(
            f"--commit-file={str(path)!r}: commit = {commit!r}: must be 40 hex digits"
        )
    return commit


def write_commit(root: Path, path: Path) -> str:
    """Name this clone's HEAD as the baseline commit; refused while the code differs from it (the
    file would name code that was never measured)."""
    from tspbench.runtime.record import utc_now, write_atomic

    head = git(root, "rev-parse", "HEAD")
    if head.returncode:
        raise ConfigError(f"{root}: not a git clone: no commit to name as the baseline")
    dirty = git(root, "status", "--porcelain", "--", *PACKAGES).stdout.decode()
    if dirty.strip():
        first = dirty.splitlines()[0]
        raise ConfigError(f"--update: the code differs from HEAD ({first.strip()}): commit first")
    commit = head.stdout.decode().strip()
    text = json.dumps({"commit": commit, "created_utc": utc_now()}, indent=2) + "\n"
    write_atomic(path, text)
    return commit


def extract(root: Path, commit: str, dest: Path) -> Path:
    """The baseline commit's packages under ``dest`` (a missing commit: one line, exit 2)."""
    if git(root, "cat-file", "-e", f"{commit}^{{commit}}").returncode:
        raise ConfigError(
            f"baseline commit {commit} is not in the clone at {root} (a shallow clone? "
            "git fetch --unshallow)"
        )
    out = git(root, "archive", "--format=tar", commit, "--", *PACKAGES)
    if out.returncode:
        raise ConfigError(f"git archive {commit}: {out.stderr.decode().strip()}")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(out.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def sides(baseline_tree: Path, current_tree: Path) -> tuple[Side, Side]:
    """A and B. Each run imports its own tree first (PYTHONPATH, and the working directory that
    ``python -m`` puts before it); an injected fault (TSPBENCH_FAULT) is a drill of the code
    under test, so only B sees it (the baseline commit may not know its kind)."""

    def env(tree: Path) -> dict[str, str]:
        path = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))
        return {**os.environ, "PYTHONPATH": path}

    a = env(baseline_tree)
    a.pop("TSPBENCH_FAULT", None)
    b = env(current_tree)
    return Side("A (baseline)", baseline_tree, a), Side("B (current)", current_tree, b)


def run_cell(cell: Cell, config: dict, side: Side, out: Path) -> dict:
    """One run of ``cell`` by ``side``'s code; its record (``status`` says whether it ran)."""
    argv = [sys.executable, "-m", "tspbench", "run", *run_args(cell, config)]
    argv += ["--launch", "local", "--nproc", str(cell.gpus), "--out", str(out)]
    limit = float(config.get("timeout") or 300) + 120
    try:
        proc = subprocess.run(
            argv, cwd=side.tree, env=side.env, capture_output=True, text=True, timeout=limit
        )
    except subprocess.TimeoutExpired:
        return {"status": "error", "error": f"no record after {limit:.0f} s"}
    if not out.is_file():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": "error", "error": f"exit {proc.returncode}: {last}"}
    return json.loads(out.read_text())


def measure(
    cells: list[Cell],
    config: dict,
    a: Side,
    b: Side,
    rounds: int,
    work: Path,
    metric: str,
    worse: str,
    log: Callable[[str], None] = lambda line: None,
) -> tuple[list[CellRatio], list[str]]:
    """Every cell ``rounds`` times by both sides, interleaved cell by cell (A,B in even rounds,
    B,A in odd ones): each cell's B/A ratios (above 1: B slower), and the cells B failed.
    A cell the baseline code cannot run is unusable input (exit 2)."""
    ratios: dict[str, list[float]] = {c.id: [] for c in cells}
    failed: list[str] = []
    for r in range(rounds):
        for cell in (c for c in cells if c.id not in failed):
            value = {}
            for side in (a, b) if r % 2 == 0 else (b, a):
                rec = run_cell(cell, config, side, work / f"{cell.id}.{side.name[0]}{r}.json")
                if rec.get("status") != "ok":
                    why = f"{rec.get('status')}: {rec.get('error', '')}"[:300]
                    if side is a:
                        raise ConfigError(f"{side.name} cannot run {cell.id} ({why})")
                    log(f"{cell.id}: {side.name} failed ({why})")
                    failed.append(cell.id)
                    break
                value[side.name] = float(rec[metric])
            else:
                ratio = value[b.name] / value[a.name]
                ratios[cell.id].append(ratio if worse == "higher" else 1 / ratio)
                log(f"round {r + 1}/{rounds} {cell.id}: B/A {ratios[cell.id][-1]:.3f}")
    return [CellRatio(c, v) for c, v in ratios.items() if c not in failed], failed


def judge(cells: list[CellRatio], rule: dict) -> tuple[float, bool]:
    """Marks each cell beyond ``cell_tolerance``; returns the median over cells of their median
    ratios (a uniform slowdown) and whether it is beyond ``median_tolerance``."""
    for c in cells:
        c.verdict = "regression" if c.median - 1 > rule["cell_tolerance"] else "ok"
    level = statistics.median(c.median for c in cells) if cells else 1.0
    return level, level - 1 > rule["median_tolerance"]


def report(cells: list[CellRatio], failed: list[str], level: float, bad: bool, rule: dict) -> str:
    n_bad = sum(c.verdict == "regression" for c in cells) + len(failed) + bad
    rows = [
        f"**A/B timing check** ({rule['metric']}, B/A over {rule['rounds']} interleaved rounds; "
        f"a cell fails above +{rule['cell_tolerance']:.0%}, the median over cells above "
        f"+{rule['median_tolerance']:.0%}): {len(cells) + len(failed)} cells, "
        f"{n_bad} regression(s)\n",
        "| cell | B/A median | B/A per round | verdict |",
        "|---|---|---|---|",
    ]
    rows += [
        f"| {c.cell} | {c.median:.3f} | {' '.join(f'{r:.3f}' for r in c.ratios)} | {c.verdict} |"
        for c in cells
    ]
    rows += [f"| {c} | | | failed (current code) |" for c in failed]
    verdict = "regression" if bad else "ok"
    rows.append(f"| (median over cells) | {level:.3f} | | {verdict} |")
    return "\n".join(rows) + "\n"


def load_cells(path: str) -> tuple[list[Cell], dict]:
    """The A/B config's cells: a sweep config (local launcher: both sides run here)."""
    from tspbench.pipeline.cells import load_config

    config = load_config(path)
    if config["launcher"] != "local":
        raise ConfigError(f"--config={path!r}: launcher = {config['launcher']!r}: must be local")
    return sweep_cells(config)[0], config
