"""No value reaches a rule's shell line unquoted: every placeholder of every `shell:` directive
carries Snakemake's `:q`, except the two lines built in Python with shlex; and a workflow run
from a directory whose name holds a space and `$(...)`, with a config note full of shell
metacharacters, prints every rule's command with those values quoted, and runs two rules for
real without executing any of it."""

from __future__ import annotations

import ast
import re
import shutil
import string
import subprocess
import sys
from pathlib import Path

import yaml

from tests.helpers.runner import ROOT, copy_workflow

# placeholders that hold a shell fragment already quoted, argument by argument, in Python
PREQUOTED = {
    "params.line": "run_line (workflows/rules/common.smk): cells.command's shlex.quote",
    "params.args": "the estimate rule's shlex.join of the cell's argv",
}
WEIRD = "work dir $(touch PWNED) ;x"
NOTE = "it's $(touch PWNED2); `touch PWNED3` > x"


def shell_lines() -> dict[str, str]:
    """Each rule's `shell:` string, as Snakemake reads it (adjacent literals joined)."""
    found = {}
    for path in sorted((ROOT / "workflows/rules").glob("*.smk")):
        text = path.read_text()
        for m in re.finditer(r"^rule (\w+):\n(.*?)(?=^\S|\Z)", text, re.M | re.S):
            shell = re.search(r"^    shell:\n((?:        \".*\"\n?)+)", m.group(2), re.M)
            if shell:
                parts = shell.group(1).split("\n")
                found[m.group(1)] = "".join(ast.literal_eval(p.strip()) for p in parts if p)
    return found


def test_every_placeholder_of_every_shell_line_is_quoted():
    lines = shell_lines()
    assert {"run", "aggregate", "tables", "figures", "regress", "estimate", "claims"} <= set(lines)
    assert {"plan_map", "plan_check", "projected_report"} <= set(lines)
    bare = [
        f"{rule}: {{{field}}}"
        for rule, line in lines.items()
        for _, field, spec, _ in string.Formatter().parse(line)
        if field is not None and spec != "q" and field not in PREQUOTED
    ]
    assert not bare, f"unquoted placeholders (add :q): {bare}"


def _outside_quotes(cmd: str) -> str:
    """What the shell reads unquoted: the command less its '...' and "..." segments."""
    return re.sub(r"'[^']*'|\"[^\"]*\"", "", cmd)


def _commands(out: str) -> list[tuple[str, str]]:
    """(rule, printed shell command) of each job of a dry run with -p."""
    jobs = [
        (re.search(r"^rule (\w+):", block, re.M), re.search(r"^Shell command: (.*)$", block, re.M))
        for block in out.split("\n\n")
    ]
    return [(r.group(1), c.group(1)) for r, c in jobs if r and c and c.group(1) != "None"]


def _weird_workflow(tmp_path: Path) -> Path:
    """A copy of the workflow in a folder named WEIRD, beside the interpreter's environment
    linked under WEIRD too (Python keeps the linked path as sys.executable, which the rules
    call)."""
    work = tmp_path / WEIRD
    work.mkdir()
    (tmp_path / "env" / WEIRD).parent.mkdir()
    (tmp_path / "env" / WEIRD).symlink_to(Path(sys.executable).parents[1])
    copy_workflow(work)
    cfg = yaml.safe_load((ROOT / "workflows/config/ci.yaml").read_text())
    (work / "q.yaml").write_text(yaml.safe_dump({**cfg, "name": "q", "note": NOTE}))
    return work


def smk(work: Path, *args: str) -> subprocess.CompletedProcess:
    python = work.parent / "env" / WEIRD / "bin" / Path(sys.executable).name
    return subprocess.run(
        [str(python), "-m", "snakemake", *args], capture_output=True, text=True, cwd=work,
        timeout=600,
    )  # fmt: skip


def test_paths_and_notes_with_shell_metacharacters_are_quoted_in_every_rule(tmp_path):
    work = _weird_workflow(tmp_path)
    targets = ["all", "plan", "project", "regress"]
    p = smk(work, *targets, "-n", "-p", "--cores", "2", "--configfile", "q.yaml")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    commands = _commands(out)
    assert set(shell_lines()) == {rule for rule, _ in commands}
    with_weird = [c for _, c in commands if WEIRD in c or "PWNED2" in c]
    assert len(with_weird) == len(commands)  # the interpreter's path is in every one
    for rule, cmd in commands:
        bare = _outside_quotes(cmd)
        assert "$(" not in bare and "`" not in bare and "work dir" not in bare, (rule, cmd)

    # two of them for real (the tables from a committed summary; the paper's claims)
    (work / "results/q").mkdir()
    summary = ROOT / "results/reference/calibration/default-summary-1.csv"
    shutil.copy(summary, work / "results/q/summary.csv")
    real = ["results/q/tables/failures.md", "results/q/claims.csv"]
    p = smk(
        work, *real, "--allowed-rules", "tables", "claims", "--cores", "1", "--configfile", "q.yaml"
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert NOTE in (work / "results/q/tables/md/memory_vs_seq.md").read_text()
    assert (work / "results/q/claims.md").exists()
    assert not list(tmp_path.rglob("PWNED*")) and not list(ROOT.glob("PWNED*"))
