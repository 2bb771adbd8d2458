"""The A/B timing check: the baseline commit's code (A) and the current code (B) time the same
cells on this machine, interleaved, and only their ratio is judged.

A timing compared with a table recorded on another machine moves with the machine (another CPU
model under one hardware id, a busy neighbour); a ratio measured in one run does not: both sides
share the machine and its load. The cells run round by round, side by side (A then B, then B
then A: the order alternates, as ``asv continuous`` does, so a drift in load hits both sides
alike). A cell's slowdown is B/A of the fastest timed step each side reached over its rounds:
load only ever adds time, and on a shared 2-core machine a run's median step moved by up to 2x
between neighbouring runs of the same code while the fastest step over the interleaved rounds
stayed within a few percent (docs/pipeline.md). A cell fails beyond ``cell_tolerance``, and the
median over all cells, a uniform slowdown, beyond ``median_tolerance`` (the ``ab`` section of
the tolerances). The baseline code is the commit named in ``results/baselines/ab.json``, its
packages extracted with ``git archive`` (nothing is left in the clone's ``.git``). Exit codes as
for ``regress``: 0 clean, 1 a regression or a cell the current code cannot run, 2 unusable input
(among it a baseline commit absent from the clone, or one that cannot run a cell).
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
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
    a: list[float]  # every timed step's seconds (the slowest rank's), over all rounds
    b: list[float]
    rounds: int = 0
    verdict: str = "ok"  # ok|regression

    @property
    def ratio(self) -> float:
        """B/A of the fastest steps: above 1, the current code is slower."""
        return min(self.b) / min(self.a)


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
    out.unlink(missing_ok=True)  # (a kept --work folder: never read an earlier run's record)
    try:
        proc = subprocess.run(
            argv, cwd=side.tree, env=side.env, capture_output=True, text=True, timeout=limit
        )
    except subprocess.TimeoutExpired:
        return {"status": "error", "error": f"no record after {limit:.0f} s"}
    try:
        rec = json.loads(out.read_text())
    except (OSError, ValueError):  # no record, or not one
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": "error", "error": f"exit {proc.returncode}: {last}"}
    return rec if isinstance(rec, dict) else {"status": "error", "error": "not a record"}


def step_times(rec: dict) -> list[float] | None:
    """A record's timed steps, if it ran and every one is a finite positive number of seconds."""
    steps = rec.get("step_times_s")
    if rec.get("status") != "ok" or not isinstance(steps, list) or not steps:
        return None
    ok = all(isinstance(t, (int, float)) and 0 < t < math.inf for t in steps)
    return [float(t) for t in steps] if ok else None


@dataclass
class Trial:
    """Both sides' timed steps per cell over the rounds run so far, and the cells the current
    code failed."""

    config: dict
    a: Side
    b: Side
    work: Path
    log: Callable[[str], None] = lambda line: None
    steps: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    rounds: dict[str, int] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)

    def measure(self, cells: list[Cell], rounds: int) -> None:
        """``rounds`` more rounds of ``cells`` by both sides, interleaved cell by cell (A,B in
        a cell's even rounds, B,A in its odd ones). A cell the baseline code cannot run is
        unusable input (exit 2)."""
        a, b = self.a, self.b
        for _ in range(rounds):
            for cell in (c for c in cells if c.id not in self.failed):
                s = self.steps.setdefault(cell.id, {a.name: [], b.name: []})
                r = self.rounds.get(cell.id, 0)
                for side in (a, b) if r % 2 == 0 else (b, a):
                    out = self.work / f"{cell.id}.{side.name[0]}{r}.json"
                    rec = run_cell(cell, self.config, side, out)
                    if (times := step_times(rec)) is None:
                        why = f"{rec.get('status')}: {rec.get('error', 'no valid step_times_s')}"
                        if side is a:
                            raise ConfigError(f"{side.name} cannot run {cell.id} ({why[:300]})")
                        self.log(f"{cell.id}: {side.name} failed ({why[:300]})")
                        self.failed.append(cell.id)
                        break
                    s[side.name] += times
                else:
                    self.rounds[cell.id] = r + 1
                    self.log(
                        f"round {r + 1} {cell.id}: fastest step A {min(s[a.name]) * 1e3:.1f} ms,"
                        f" B {min(s[b.name]) * 1e3:.1f} ms"
                    )

    def cells(self) -> list[CellRatio]:
        a, b = self.a.name, self.b.name
        return [
            CellRatio(c, s[a], s[b], self.rounds[c])
            for c, s in self.steps.items()
            if c not in self.failed
        ]


def judge(cells: list[CellRatio], rule: dict) -> tuple[float, bool]:
    """Marks each cell beyond ``cell_tolerance``; returns the median over cells of their ratios
    (a uniform slowdown) and whether it is beyond ``median_tolerance``."""
    for c in cells:
        c.verdict = "regression" if c.ratio - 1 > rule["cell_tolerance"] else "ok"
    level = statistics.median(c.ratio for c in cells) if cells else 1.0
    return level, level - 1 > rule["median_tolerance"]


def check(trial: Trial, cells: list[Cell], rule: dict) -> tuple[list[CellRatio], float, bool]:
    """``rounds`` rounds of every cell, judged; a cell in doubt, more than half its tolerance
    away from 1 either way (every cell, if the median over cells is more than half its own),
    gets ``confirm_rounds`` more before the verdict is final. A burst of load that hit only one
    side's runs passes the second look, slower code fails it again; and a cell that looks much
    faster is looked at again too: on a shared machine that is a baseline whose runs were all
    slowed, which would hide a slowdown of the current code."""
    trial.measure(cells, rule["rounds"])
    judged = trial.cells()
    level, bad = judge(judged, rule)
    every = abs(level - 1) > rule["median_tolerance"] / 2
    doubt = rule["cell_tolerance"] / 2
    suspects = {c.cell for c in judged if every or abs(c.ratio - 1) > doubt}
    if suspects and rule["confirm_rounds"]:
        trial.log(f"confirming {len(suspects)} cell(s): {rule['confirm_rounds']} more rounds")
        trial.measure([c for c in cells if c.id in suspects], rule["confirm_rounds"])
        judged = trial.cells()
        level, bad = judge(judged, rule)
    return judged, level, bad


def report(cells: list[CellRatio], failed: list[str], level: float, bad: bool, rule: dict) -> str:
    n_bad = sum(c.verdict == "regression" for c in cells) + len(failed) + bad
    rows = [
        f"**A/B timing check** (B/A of the fastest step over the interleaved rounds; a cell "
        f"fails above +{rule['cell_tolerance']:.0%}, the median over cells above "
        f"+{rule['median_tolerance']:.0%}): {len(cells) + len(failed)} cells, "
        f"{n_bad} regression(s)\n",
        "| cell | B/A | fastest step A (ms) | fastest step B (ms) | rounds | verdict |",
        "|---|---|---|---|---|---|",
    ]
    rows += [
        f"| {c.cell} | {c.ratio:.3f} | {min(c.a) * 1e3:.1f} | {min(c.b) * 1e3:.1f} | {c.rounds} "
        f"| {c.verdict} |"
        for c in cells
    ]
    rows += [f"| {c} | | | | | failed (current code) |" for c in failed]
    verdict = "regression" if bad else "ok"
    rows.append(f"| (median over cells) | {level:.3f} | | | | {verdict} |")
    return "\n".join(rows) + "\n"


def load_cells(path: str) -> tuple[list[Cell], dict]:
    """The A/B config's cells: a sweep config (local launcher: both sides run here)."""
    from tspbench.pipeline.cells import load_config

    config = load_config(path)
    if config["launcher"] != "local":
        raise ConfigError(f"--config={path!r}: launcher = {config['launcher']!r}: must be local")
    return sweep_cells(config)[0], config
