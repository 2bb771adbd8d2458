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
from tspbench.pipeline.cells import sweep_cells

RULE = regress.load_tolerances(ROOT / "workflows/regress.yaml")["ab"]


def verdicts(b_over_a: dict[str, float]) -> tuple[list[str], bool]:
    """Each cell's A steps, and B's: one disturbed step each, then the fastest times the ratio."""
    a = [0.101, 0.4, 0.1, 0.25]
    cells = [ab.CellRatio(c, a, [t * r for t in a[::-1]]) for c, r in b_over_a.items()]
    _, bad = ab.judge(cells, RULE)
    return [c.verdict for c in cells], bad


def test_noise_passes_a_uniform_or_one_cell_slowdown_fails():
    noise = {"tsp": 1.07, "tp": 0.95, "sp": 1.0}
    assert verdicts(noise) == (["ok", "ok", "ok"], False)
    assert verdicts({c: r * 1.15 for c, r in noise.items()})[1]  # the median over cells: 1.15
    assert verdicts({**noise, "tsp": 1.4}) == (["regression", "ok", "ok"], False)


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


CONFIG = {
    "name": "ab", "model": "tiny", "model_overrides": {"ffn": 256}, "dtype": "fp32", "warmup": 1,
    "steps": 3, "seed": 0, "recompute": "none", "gpu": False, "gpus_per_node": 2,
    "launcher": "local",
    "sweeps": [{"name": "ab", "strategies": ["tsp", "tp", "sp"], "degrees": [2], "gpus": [2],
                "seq_lens": [256], "batches": [1], "modes": ["train"]}],
}  # fmt: skip


def scripted(monkeypatch, tmp_path, slowdown) -> tuple[ab.Trial, list]:
    """A trial whose runs are scripted: ``slowdown(cell, side, n)`` is the factor on a 0.1 s
    step in the n-th run of that cell by that side (A: "A", B: "B"); nothing is launched."""
    runs: dict[tuple[str, str], int] = {}

    def run_cell(cell, config, side, out):
        n = runs[cell.id, side.name[0]] = runs.get((cell.id, side.name[0]), -1) + 1
        factor = slowdown(cell.spec.strategy, side.name[0], n)
        if factor is None:
            return {"status": "error", "error": "injected"}
        return {"status": "ok", "step_times_s": [0.1 * factor, 0.12 * factor, 0.11 * factor]}

    monkeypatch.setattr(ab, "run_cell", run_cell)
    side = ab.Side("A (baseline)", tmp_path, {}), ab.Side("B (current)", tmp_path, {})
    cells = sweep_cells(CONFIG)[0]
    return ab.Trial(CONFIG, *side, tmp_path), cells


def test_a_burst_of_load_is_looked_at_again_a_slower_strategy_fails_twice(monkeypatch, tmp_path):
    # B's first two runs of tsp hit by load (x1.6): in doubt, confirmed ok by two more rounds
    trial, cells = scripted(
        monkeypatch, tmp_path, lambda s, side, n: 1.6 if (s, side) == ("tsp", "B") and n < 3 else 1
    )
    judged, level, bad = ab.check(trial, cells, RULE)
    assert [(c.cell[:3], c.verdict, c.rounds) for c in judged] == [
        ("tsp", "ok", 3 + RULE["confirm_rounds"]), ("tp.", "ok", 3), ("sp.", "ok", 3)
    ] and not bad  # fmt: skip
    trial, cells = scripted(
        monkeypatch, tmp_path, lambda s, side, n: 1.4 if (s, side) == ("tsp", "B") else 1
    )
    judged, level, bad = ab.check(trial, cells, RULE)
    assert [c.verdict for c in judged] == ["regression", "ok", "ok"] and not bad
    assert judged[0].rounds == 3 + RULE["confirm_rounds"] and judged[0].ratio == pytest.approx(1.4)


def test_a_baseline_slowed_by_load_does_not_hide_a_slowdown(monkeypatch, tmp_path):
    """Every cell 15% slower, but the baseline's first three runs of tsp and tp ran at half speed
    (another job on the machine): both look faster, are looked at again, and the median fails."""
    trial, cells = scripted(
        monkeypatch, tmp_path,
        lambda s, side, n: 1.15 if side == "B" else 2.0 if s != "sp" and n < 3 else 1,
    )  # fmt: skip
    judged, level, bad = ab.check(trial, cells, RULE)
    assert bad and level == pytest.approx(1.15), ab.report(judged, [], level, bad, RULE)


def test_a_uniform_slowdown_fails_the_median(monkeypatch, tmp_path):
    trial, cells = scripted(monkeypatch, tmp_path, lambda s, side, n: 1.15 if side == "B" else 1)
    judged, level, bad = ab.check(trial, cells, RULE)
    assert bad and level == pytest.approx(1.15) and all(c.verdict == "ok" for c in judged)


def test_a_cell_only_the_baseline_cannot_run_is_unusable_input(monkeypatch, tmp_path):
    trial, cells = scripted(
        monkeypatch, tmp_path, lambda s, side, n: None if (s, side) == ("tp", "B") else 1
    )
    judged, _, _ = ab.check(trial, cells, RULE)
    assert trial.failed == ["tp.D2.g2.S256.B1.train"] and len(judged) == 2
    trial, cells = scripted(monkeypatch, tmp_path, lambda s, side, n: None if side == "A" else 1)
    with pytest.raises(ConfigError, match="A .baseline. cannot run tsp.D2.g2.S256.B1.train"):
        ab.check(trial, cells, RULE)
