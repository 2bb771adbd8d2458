"""The Snakemake report of a sweep whose records exist (synthetic, so no cell runs): it shows
the tables themselves (HTML), every figure as an image, captions that hold for any config, and
labels naming the hardware the records ran on."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
import yaml

from tests.helpers.records import CPU, write_records
from tests.helpers.runner import copy_workflow
from tests.helpers.runner import snakemake as smk

# four sweeps that share cells: the seq sweep's S = 128 training cells are the degree sweep's
# D = 4 column, its S = 64 cells the batch sweep's B = 1 column
REPORT = {
    "name": "rep",
    "model": "tiny",
    "dtype": "fp32",
    "warmup": 0,
    "steps": 1,
    "gpus_per_node": 4,
    "launcher": "local",
    "note": "",
    "sweeps": [
        {
            "name": "seq",
            "strategies": ["tsp", "tp"],
            "degrees": [4],
            "gpus": [4],
            "seq_lens": [64, 128],
            "batches": [1],
            "modes": ["train", "infer"],
        },
        {
            "name": "degree",
            "strategies": ["tsp", "tp"],
            "degrees": [2, 4],
            "gpus": [4],
            "seq_lens": [128],
            "batches": [1],
            "modes": ["train"],
        },
        {
            "name": "batch",
            "strategies": ["tsp", "tp"],
            "degrees": [4],
            "gpus": [4],
            "seq_lens": [64],
            "batches": [1, 2, 4],
            "modes": ["train"],
        },
        {
            "name": "scaling",
            "strategies": ["tsp", "tp"],
            "degrees": [2],
            "gpus": [2, 4],
            "seq_lens": [128],
            "batches": [1],
            "modes": ["infer"],
        },
        {  # decode: the KV cache vs prompt length and tokens/s vs batch, single beside
            "name": "decode",
            "strategies": ["tsp", "tp"],
            "degrees": [2],
            "gpus": [2],
            "seq_lens": [64, 128],
            "batches": [1, 2],
            "modes": ["decode"],
            "new_tokens": [4],
        },
        {
            "name": "decode",
            "strategies": ["single"],
            "degrees": [1],
            "gpus": [1],
            "seq_lens": [64, 128],
            "batches": [1, 2],
            "modes": ["decode"],
            "new_tokens": [4],
        },
    ],
}


def _results(html: str) -> dict:
    """The report's table of results (path -> name, labels, caption, mime type, data URI)."""
    match = re.search(r"var results = (\{.*?\});\n", html, re.S)
    assert match, "no results table in the report"
    return json.loads(match.group(1))


def _data(entry: dict) -> bytes:
    return base64.b64decode(entry["data_uri"].split("base64,", 1)[1])


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[Path, dict]:
    from tspbench.pipeline.cells import sweep_cells

    work = tmp_path_factory.mktemp("report")
    copy_workflow(work)
    (work / "rep.yaml").write_text(yaml.safe_dump(REPORT))
    cells, _ = sweep_cells(REPORT)
    write_records(cells, work / "results/rep/runs", launcher="local", hardware=CPU)
    p = smk("--cores", "2", "--configfile", "rep.yaml", cwd=work, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "rule run:" not in p.stdout + p.stderr  # the records are there: no cell runs
    p = smk("--configfile", "rep.yaml", "--report", "report.html", cwd=work, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return work, _results((work / "report.html").read_text())


def test_the_report_shows_the_tables_themselves(report):
    work, results = report
    tables = {e["name"]: e for e in results.values() if e["mime_type"] == "text/html"}
    expected = {p.name for p in (work / "results/rep/tables/html").glob("*.html")}
    assert expected and set(tables) >= expected | {"failures.html"}
    for name in (
        "memory_vs_degree_S128.html",
        "scaling_infer_S128.html",
        "batch_memory.html",
        "memory_vs_seq_infer.html",
    ):
        page = _data(tables[name]).decode()
        assert "<table" in page and "<td>" in page, name
        rows = re.findall(r"<td>(tsp|tp)</td>", page)
        assert rows == ["tsp", "tp"], (name, rows)  # the strategy order: TSP first
    degree = _data(tables["memory_vs_degree_S128.html"]).decode()
    assert re.findall(r"<th>(\d+)</th>", degree) == ["2", "4"]  # D = 4: the seq sweep's cells
    batch = _data(tables["batch_memory.html"]).decode()
    assert re.findall(r"<th>(\d+)</th>", batch) == ["1", "2", "4"]
    assert not any(e["name"].endswith(".md") for e in results.values())


def test_the_report_shows_every_figure_with_a_true_caption(report):
    work, results = report
    figures = {e["name"]: e for e in results.values() if e["mime_type"] == "image/png"}
    expected = {p.name for p in (work / "plots/rep/png").glob("*.png")}
    assert expected and set(figures) == expected
    assert {"throughput_vs_gpus_infer_S128.png", "memory_vs_degree_S128.png"} <= expected
    decode = {"kv_cache_vs_seq_B1.png", "decode_throughput_vs_batch_S64.png"}
    assert decode <= expected
    assert "single-device cache" in figures["kv_cache_vs_seq_B1.png"]["caption"]
    for name, e in figures.items():
        caption = e["caption"]
        assert name.removesuffix(".png") in caption, name
        assert "2-core" not in caption and "log2 axes" not in caption, caption
        if "throughput" in name:
            assert "Error bars" in caption, caption
        if "breakdown" in name:
            assert "log2" not in caption, caption


def test_report_labels_name_the_hardware_of_the_records(report):
    _, results = report
    where = "AMD EPYC 7763 64-Core Processor, 2 CPUs (CPU ranks)"
    shown = [e for e in results.values() if e["mime_type"] in ("image/png", "text/html")]
    assert shown
    for e in shown:
        if e["name"] != "failures.html":
            assert e["labels"]["hardware"] == where, e["labels"]


def test_the_landing_page_shows_the_claims_table_and_links_every_figure(report):
    """Issue 36: the report opened on the rule graph alone. Its landing page
    (workflows/report/workflow.rst) now holds the claims table itself, every row, and a link to
    every figure of the run."""
    import html

    import pandas as pd

    work, _ = report
    page = (work / "report.html").read_text()
    claims = pd.read_csv(work / "results/rep/claims.csv")
    assert len(claims)
    for claim in claims["claim"]:  # (docutils escapes double quotes, not single ones)
        text = html.escape(claim, quote=False).replace('"', "&quot;")
        assert f"<td>{text}</td>" in page, claim
    figures = sorted(p.name for p in (work / "plots/rep/png").glob("*.png"))
    assert figures
    for name in figures:
        assert f"showResultInfo('plots/rep/png/{name}')" in page, name
