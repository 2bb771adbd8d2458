"""`tspbench regress`: an unchanged table passes, one more byte or more memory fails naming the
cell and metric, timings never fail it (they are judged A/B: test_ab.py), a missing cell is
reported, unusable input exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from tests.helpers.runner import ROOT
from tspbench.cli import main

TOL = str(ROOT / "workflows/regress.yaml")


def table() -> pd.DataFrame:
    rows = []
    for s in ("tsp", "tp"):
        for S in (256, 1024):
            rows.append(
                {
                    "cell": f"{s}.D2.g2.S{S}.B1.train",
                    "status": "ok",
                    "strategy": s,
                    "seq_len": S,
                    "comm_bytes_total": 1000.0 * S,
                    "comm_bytes_broadcast": 10.0 * S,
                    "param_numel": 57664,
                    "optimizer_numel": 115328,
                    "flops_per_step": 21069824 * S,
                    "peak_mem_bytes": 1e6 + S,
                    "tokens_per_s": 3000.0,
                    "tokens_per_s_per_gflops": 40.0,
                    "device_name": "AMD EPYC",
                }
            )
    return pd.DataFrame(rows)


def run(tmp_path: Path, current: pd.DataFrame, capsys, tol: str = TOL) -> tuple[int, str]:
    base, cur = tmp_path / "base.csv", tmp_path / "cur.csv"
    table().to_csv(base, index=False)
    current.to_csv(cur, index=False)
    code = main(
        [
            "regress",
            "--baseline",
            str(base),
            "--current",
            str(cur),
            "--tolerances",
            tol,
            "--out",
            str(tmp_path / "report.md"),
        ]
    )
    return code, capsys.readouterr().out


def test_unchanged_table_passes(tmp_path, capsys):
    code, out = run(tmp_path, table(), capsys)
    assert code == 0 and "0 regression(s)" in out


def test_memory_within_tolerance_passes(tmp_path, capsys):
    cur = table()
    cur["peak_mem_bytes"] *= 1.005
    code, out = run(tmp_path, cur, capsys)
    assert code == 0 and "Every cell matches" in out, out


def test_timings_of_a_busy_or_other_machine_do_not_fail_it(tmp_path, capsys):
    """The CI gate failed on a loaded machine with timing "regressions" while every exact metric
    matched: the committed baseline judges no timing (and serves every machine)."""
    cur = table()
    cur["tokens_per_s"] *= [0.31, 0.43, 0.52, 0.9]
    cur["tokens_per_s_per_gflops"] *= [0.31, 0.43, 0.52, 0.9]
    code, out = run(tmp_path, cur, capsys)
    assert code == 0 and "Every cell matches" in out, out


def test_a_measured_metric_beyond_its_tolerance_fails_within_it_is_a_notice(tmp_path, capsys):
    tol = tmp_path / "tol.yaml"
    tol.write_text(
        "exact: [flops_per_step]\n"
        "relative:\n"
        "  tokens_per_s_per_gflops: {tolerance: 0.45, notice_tolerance: 0.2, worse: lower}\n"
    )
    cur = table()
    cur.loc[1, "tokens_per_s_per_gflops"] *= 0.7
    code, out = run(tmp_path, cur, capsys, str(tol))
    assert code == 0 and "-30.0% | slower |" in out, out
    cur.loc[1, "tokens_per_s_per_gflops"] = 20.0  # half the baseline's 40
    code, out = run(tmp_path, cur, capsys, str(tol))
    assert code == 1
    assert "| tsp.D2.g2.S1024.B1.train | tokens_per_s_per_gflops |" in out
    assert "-50.0% | regression |" in out


def test_one_more_byte_element_fails(tmp_path, capsys):
    cur = table()
    cur.loc[2, "comm_bytes_broadcast"] += 4  # one fp32 element more
    code, out = run(tmp_path, cur, capsys)
    assert code == 1 and "| tp.D2.g2.S256.B1.train | comm_bytes_broadcast |" in out


def test_more_memory_fails_less_is_an_improvement(tmp_path, capsys):
    cur = table()
    cur.loc[0, "peak_mem_bytes"] *= 1.05
    cur.loc[3, "peak_mem_bytes"] *= 0.8
    code, out = run(tmp_path, cur, capsys)
    assert code == 1
    assert "tsp.D2.g2.S256.B1.train | peak_mem_bytes" in out and "improvement" in out


def test_missing_and_failed_cells_are_reported(tmp_path, capsys):
    cur = table().drop(index=3)
    cur.loc[0, "status"] = "oom"
    code, out = run(tmp_path, cur, capsys)
    assert code == 1
    assert "| tp.D2.g2.S1024.B1.train | cell | present | missing |  | missing |" in out
    assert "| tsp.D2.g2.S256.B1.train | status | ok | oom |  | failed |" in out


def test_new_cells_are_reported_not_failed(tmp_path, capsys):
    extra = table().iloc[[0]].assign(cell="sp.D2.g2.S256.B1.train")
    code, out = run(tmp_path, pd.concat([table(), extra]), capsys)
    assert code == 0 and "| new |" in out


@pytest.mark.parametrize("bad", ["nothing.csv", "notatable"])
def test_unusable_input_exits_2(tmp_path, capsys, bad):
    cur = tmp_path / "cur.csv"
    if bad == "notatable":
        cur.write_text("a,b\n1,2\n")
    code = main(["regress", "--baseline", str(cur), "--current", str(cur), "--tolerances", TOL])
    assert code == 2


def _zero_memory(t: pd.DataFrame) -> pd.DataFrame:
    return t.assign(peak_mem_bytes=0.0)


def _nan_memory(t: pd.DataFrame) -> pd.DataFrame:
    return t.assign(peak_mem_bytes=float("nan"))


def _negative_bytes(t: pd.DataFrame) -> pd.DataFrame:
    return t.assign(comm_bytes_total=-1.0)


@pytest.mark.parametrize(
    "spoil, needle",
    [
        (_zero_memory, "peak_mem_bytes = 0.0: must be finite and > 0"),
        (_nan_memory, "peak_mem_bytes = nan: must be finite and > 0"),
        (_negative_bytes, "comm_bytes_total = -1.0: must be finite and >= 0"),
        (lambda t: t.iloc[:0], "holds no cells"),
        ("cut", "row 5 has 5 fields, the header 13 (a file cut short?)"),
    ],
)
@pytest.mark.parametrize("where", ["baseline", "update"])
def test_a_baseline_that_would_pass_everything_is_refused(tmp_path, capsys, spoil, needle, where):
    """Zeros, NaNs, no cells or a cut file: a gate that compared against them would say "every
    cell matches" (or flag noise); it is unusable input, exit 2, one line, and --update never
    writes such a baseline."""
    bad, good = tmp_path / "bad.csv", tmp_path / "good.csv"
    table().to_csv(good, index=False)
    if spoil == "cut":
        bad.write_text(good.read_text()[: good.read_text().rindex("\n", 0, -1) + 40])
    else:
        spoil(table()).to_csv(bad, index=False)
    if where == "baseline":
        argv = ["--baseline", str(bad), "--current", str(good)]
    else:
        argv = ["--update", "--current", str(bad), "--baseline", str(tmp_path / "new.csv")]
    assert main(["regress", *argv, "--tolerances", TOL]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "new.csv").exists()


def test_update_writes_baseline_and_provenance(tmp_path, capsys):
    cur = tmp_path / "cur.csv"
    table().to_csv(cur, index=False)
    base = tmp_path / "b" / "ci.csv"
    slower = tmp_path / "slower.csv"
    table().assign(peak_mem_bytes=2e6).to_csv(slower, index=False)
    assert (
        main(
            [
                "regress",
                "--update",
                "--current",
                str(cur),
                str(cur),
                str(slower),
                "--baseline",
                str(base),
                "--tolerances",
                TOL,
            ]
        )
        == 0
    )
    assert (pd.read_csv(base)["peak_mem_bytes"] < 2e6).all()  # median of 3 repeats
    assert json.loads(base.with_suffix(".json").read_text())["repeats"] == 3
    assert base.exists() and base.with_suffix(".json").exists()
    assert (
        main(["regress", "--current", str(cur), "--baseline", str(base), "--tolerances", TOL]) == 0
    )


def test_committed_baseline_matches_the_ci_sweep_cells():
    """The committed baseline covers exactly the CI sweep's cells."""
    import yaml

    from tspbench.pipeline.cells import sweep_cells

    cfg = yaml.safe_load((ROOT / "workflows/config/ci.yaml").read_text())
    cells = {c.id for c in sweep_cells(cfg)[0]}
    base = pd.read_csv(ROOT / "results/baselines/ci.csv")
    assert set(base["cell"]) == cells and set(base["status"]) == {"ok"}


def test_committed_default_baseline_matches_the_default_pipeline_cells():
    """CI judges README command 1's table (the default pipeline) against this baseline: it
    covers exactly the default config's cells, every one of them ok."""
    import yaml

    from tspbench.pipeline.cells import sweep_cells

    cfg = yaml.safe_load((ROOT / "workflows/config/default.yaml").read_text())
    cells = {c.id for c in sweep_cells(cfg)[0]}
    base = pd.read_csv(ROOT / "results/baselines/default.csv")
    assert set(base["cell"]) == cells and set(base["status"]) == {"ok"}


def test_the_ci_baseline_judges_exact_metrics_on_any_machine(tmp_path, monkeypatch, capsys):
    """Another core count once found no baseline (cpu-4c.csv) and refused even the exact checks:
    the one baseline serves every machine; one more FLOP in one cell fails."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    cur = pd.read_csv(ROOT / "results/baselines/ci.csv")
    cur["tokens_per_s_per_gflops"] *= 0.5  # and a slow machine's timings
    cur.to_csv(tmp_path / "same.csv", index=False)
    cur.loc[3, "flops_per_step"] += 1
    cur.to_csv(tmp_path / "more.csv", index=False)
    assert main(["regress", "--current", str(tmp_path / "same.csv")]) == 0
    assert main(["regress", "--current", str(tmp_path / "more.csv")]) == 1
    assert f"| {cur.loc[3, 'cell']} | flops_per_step |" in capsys.readouterr().out
