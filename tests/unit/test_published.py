"""``project-check --published``: the committed points are complete and sourced, the command
prints one row per point whose ratio is the project API's own, and bad input exits 2 with one
line naming the field, value and rule (issue 29)."""

from __future__ import annotations

import copy
import json
import re

import pytest

from tspbench.cli import main
from tspbench.core.config import get_config
from tspbench.projection import published
from tspbench.projection.costmodel import load_preset, presets, project
from tspbench.runtime.registry import strategies
from tspbench.runtime.spec import RunSpec


def _data() -> dict:
    return json.loads(published.default_path().read_text())


def test_committed_file_is_complete_and_sourced():
    data = _data()
    assert "no rate" in data["_doc"] and "fitted" in data["_doc"]
    points = data["points"]
    assert len(points) >= 6
    assert len({p["source"]["url"] for p in points}) >= 2
    for p in points:
        assert set(published.POINT_FIELDS) <= set(p), p["id"]
        assert all(p["source"][k].strip() for k in published.SOURCE_FIELDS), p["id"]
        assert p["source"]["url"].startswith("https://"), p["id"]
        assert p["strategy"] in strategies() and p["preset"] in presets(), p["id"]
        assert all(p[k] > 0 for k in published.POSITIVE), p["id"]
        assert p["gpus"] == p["degree"] * p["dp"], p["id"]
        # the published number is in the quoted row as the source prints it
        n = p["published_tokens_per_s_per_gpu"]
        assert f"{n:,}" in p["quote"] or str(n) in p["quote"], p["id"]
    assert published.load() == points  # the checks the command runs pass too


def test_command_prints_one_row_per_point_with_the_project_ratio(capsys):
    assert main(["project-check", "--published"]) == 0
    out = capsys.readouterr().out
    points = _data()["points"]
    for p in points:  # independently of published.py: the project API by hand
        preset = load_preset(p["preset"])
        c = RunSpec.make(
            p["strategy"], get_config(p["model"], **p["set"]), degree=p["degree"], tp=p["tp"],
            sp=p["sp"], dp=p["dp"], seq_len=p["seq_len"], batch=p["batch"], mode="train",
            dtype=p["precision"], recompute=p["recompute"],
        )  # fmt: skip
        res = project(c.preset_options(preset), preset)
        ratio = res["tokens_per_s"] / p["gpus"] / p["published_tokens_per_s_per_gpu"]
        rows = [line for line in out.splitlines() if line.startswith(f"| {p['id']} |")]
        assert len(rows) == 1, p["id"]
        assert float(rows[0].rstrip(" |").rsplit("|", 1)[1]) == pytest.approx(ratio, abs=0.006)
    assert re.search(rf"{len(points)} points from \d+ source documents: .*median", out)


def _write(tmp_path, mutate) -> str:
    data = copy.deepcopy(_data())
    mutate(data["points"][0])
    path = tmp_path / "pts.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda p: p.pop("seq_len"), "seq_len=None: missing"),
        (lambda p: p.update(strategy="zero3"), "strategy='zero3': must be one of"),
        (lambda p: p.update(preset="a100"), "preset='a100': must be one of"),
        (lambda p: p.update(published_tokens_per_s_per_gpu=0), "must be a positive number"),
        (lambda p: p.update(batch=-2), "batch=-2: must be a positive number"),
        (lambda p: p.update(precision="fp8"), "precision='fp8': must be one of bf16"),
        (lambda p: p["source"].pop("url"), "source.url=None: missing"),
        (lambda p: p.update(gpus=7), "gpus=7: must equal degree x dp"),
        (lambda p: p.update(seq_len="8k"), "seq_len='8k': must be of type int"),
    ],
)
def test_bad_points_exit_2_with_one_line(tmp_path, capsys, mutate, needle):
    path = _write(tmp_path, mutate)
    assert main(["project-check", "--published", path]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "points[0]" in err[0], err
    assert captured.out == ""  # refused before anything was projected


def test_bad_files_exit_2(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "empty.json").write_text('{"points": []}')
    for name, needle in [("bad.json", "not valid JSON"), ("empty.json", "must not be empty"),
                         ("missing.json", "cannot read it")]:  # fmt: skip
        assert main(["project-check", "--published", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    assert main(["project-check", "--published", "--hardware", "h100"]) == 2
    assert "no --hardware" in capsys.readouterr().err
