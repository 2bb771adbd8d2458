"""The A/B timing check's parts without timing anything: the verdicts on B/A ratios, the
baseline commit's file (named only for committed code, refused when malformed or absent from the
clone: one line, exit 2, nothing written) and its code extracted as committed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers.runner import ROOT
from tspbench.cli import main
from tspbench.core.config import ConfigError
from tspbench.pipeline import ab, regress

RULE = regress.load_tolerances(ROOT / "workflows/regress.yaml")["ab"]


def verdicts(ratios: dict[str, list[float]]) -> tuple[list[str], bool]:
    cells = [ab.CellRatio(c, r) for c, r in ratios.items()]
    _, bad = ab.judge(cells, RULE)
    return [c.verdict for c in cells], bad


def test_noise_passes_a_uniform_or_one_cell_slowdown_fails():
    noise = {"tsp": [1.46, 0.95, 1.0], "tp": [0.9, 1.05, 1.1], "sp": [1.0, 0.6, 1.02]}
    assert verdicts(noise) == (["ok", "ok", "ok"], False)
    uniform = {c: [r * 1.15 for r in v] for c, v in noise.items()}
    assert verdicts(uniform)[1]  # the median over cells, 1.15
    one = {**noise, "tsp": [1.4, 1.38, 1.45]}
    assert verdicts(one) == (["regression", "ok", "ok"], False)


def repo(tmp_path: Path) -> tuple[Path, str]:
    """A git clone holding a file in each package a run imports, committed."""
    root = tmp_path / "clone"
    for package in ab.PACKAGES:
        (root / package).mkdir(parents=True)
        (root / package / "x.py").write_text("A = 1\n")
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
    return root, head.stdout.strip()


def test_update_names_head_only_for_committed_code_and_extract_gives_it(tmp_path):
    root, head = repo(tmp_path)
    path = tmp_path / "ab.json"
    assert ab.write_commit(root, path) == head and ab.read_commit(path) == head
    (root / "tspbench" / "x.py").write_text("A = 2\n")
    with pytest.raises(ConfigError, match=r"the code differs from HEAD \(M tspbench/x.py\)"):
        ab.write_commit(root, tmp_path / "other.json")
    assert not (tmp_path / "other.json").exists()
    tree = ab.extract(root, head, tmp_path / "a")
    assert (tree / "tspbench" / "x.py").read_text() == "A = 1\n"  # the commit's, not the tree's


@pytest.mark.parametrize(
    "text, needle",
    [
        ('{"commit": "' + "0" * 40 + '"}', "is not in the clone at"),
        ('{"commit": "HEAD"}', "commit = 'HEAD': must be 40 hex digits"),
        ("[1, 2", "not JSON"),
    ],
)
def test_an_unusable_baseline_commit_exits_2_in_one_line(
    tmp_path, monkeypatch, capsys, text, needle
):
    monkeypatch.chdir(ROOT)
    (tmp_path / "ab.json").write_text(text)
    out = tmp_path / "ab.md"
    argv = ["regress-ab", "--commit-file", str(tmp_path / "ab.json"), "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not out.exists()


def test_the_committed_commit_file_names_a_commit():
    assert ab.read_commit(ROOT / ab.COMMIT_FILE)
    json.loads((ROOT / ab.COMMIT_FILE).read_text())
