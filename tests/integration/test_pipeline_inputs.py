"""Bad inputs refused where they enter the pipeline, reproduced the way they arrive from outside:
config files through ``snakemake -n --configfile`` and ``tspbench check-config``, records and
tables on disk read by ``tspbench aggregate`` and ``tspbench regress``, each a subprocess (so a
traceback shows up as the exit code a caller sees)."""

from __future__ import annotations

import json
import math
import resource
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tests.helpers.configs import MINI
from tests.helpers.runner import ROOT, copy_workflow, snakemake, tspbench

DEFAULT = yaml.safe_load((ROOT / "workflows/config/default.yaml").read_text())
MEMORY = 3 * 2**30  # address space of a subprocess fed a YAML bomb: the test box must survive


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def run_limited(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m argv`` with its memory capped (a MemoryError instead of a swamped machine)."""
    return subprocess.run(
        [sys.executable, "-m", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        preexec_fn=_limited,
    )


def bomb_config() -> str:
    """The default config whose note is nine nested aliases of nine ("billion laughs"): 1 kB of
    YAML, 9**10 strings once expanded."""
    items = ['&a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    items += [f"&a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    return yaml.safe_dump({k: v for k, v in DEFAULT.items() if k != "note"}) + (
        "note: [" + ", ".join(items) + "]\n"
    )


# -- A: the projection config --------------------------------------------------------------------


def test_projected_config_with_a_shell_command_is_refused_by_the_dry_run(tmp_path):
    """workflows/config/projected.yaml is read at parse time; a value that is not one of the
    schema's stops the dry run naming it, and nothing in it is ever run."""
    copy_workflow(tmp_path)
    proj = tmp_path / "workflows/config/projected.yaml"
    cfg = yaml.safe_load(proj.read_text())
    cfg["dtype"] = f"fp32$(touch {tmp_path / 'PWNED'})"
    proj.write_text(yaml.safe_dump(cfg))
    p = snakemake("-n", "--cores", "1", "project", cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert "config error: projected config" in out and "dtype: 'fp32$(touch" in out, out[-3000:]
    assert "is not one of ['fp32', 'bf16']" in out
    assert not (tmp_path / "PWNED").exists() and not (ROOT / "PWNED").exists()


def test_plan_config_with_a_shell_command_is_refused_by_snakemake_and_plan_map(tmp_path):
    """workflows/config/plan.yaml (tspbench/schemas/plan.schema.yaml): a value that is not the
    schema's stops `snakemake plan` at parse time, and `tspbench plan-map --config` with one
    line and exit 2; nothing in it is run, nothing is written."""
    copy_workflow(tmp_path)
    plan = tmp_path / "workflows/config/plan.yaml"
    cfg = yaml.safe_load(plan.read_text())
    cfg["focus"] = f"tsp$(touch {tmp_path / 'PWNED'})"
    plan.write_text(yaml.safe_dump(cfg))
    p = snakemake("-n", "--cores", "1", "plan", cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert "config error: plan config" in out and "focus: 'tsp$(touch" in out, out[-3000:]
    argv = ["--config", plan, "--model", "7b", "--hardware", "h100", "--out", tmp_path / "m"]
    p = tspbench("plan-map", *argv, cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr[-3000:]
    assert "focus: 'tsp$(touch" in p.stderr and "is not one of ['tsp'," in p.stderr
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "m").exists()


# -- B, C: sweep configs through snakemake and check-config ---------------------------------------

ALL_FILTERED = {"strategies": ["tp"], "degrees": [3], "gpus": [3], "seq_lens": [6], "tpsp": []}
DRY_RUN = [
    ("timeout-nan", yaml.safe_dump({**DEFAULT, "timeout": math.nan}), "timeout: nan is not a"),
    ("warmup-float", yaml.safe_dump({**DEFAULT, "warmup": 2.0}), "warmup: 2.0 is not of type"),
    ("seed", yaml.safe_dump({**DEFAULT, "seed": 2**31}), "seed: 2147483648 is greater than"),
    (
        "all-filtered",
        yaml.safe_dump(
            {
                **DEFAULT,
                "sweeps": [{**DEFAULT["sweeps"][0], **ALL_FILTERED}],
            }
        ),
        "no runnable cell: all 1 combinations are filtered",
    ),
    ("alias-bomb", bomb_config(), "a value used twice (a YAML alias?)"),
]


@pytest.mark.parametrize("text, needle", [d[1:] for d in DRY_RUN], ids=[d[0] for d in DRY_RUN])
def test_bad_sweep_config_stops_the_dry_run(tmp_path, text, needle):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    p = run_limited("snakemake", "-n", "--cores", "1", "--configfile", str(path))
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "MemoryError" not in out, out[-3000:]
    assert "config error: config: " in out and needle in out, out[-3000:]


def test_check_config_refuses_a_yaml_alias_bomb_in_one_line(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(bomb_config())
    p = run_limited("tspbench", "check-config", str(path))
    assert p.returncode == 2, p.stderr[-3000:]
    assert "YAML alias *a0: aliases are not allowed" in p.stderr and p.stderr.count("\n") == 1


# -- D: records ------------------------------------------------------------------------------------


def test_aggregate_turns_malformed_records_into_corrupt_rows(tmp_path):
    from tspbench.pipeline.cells import sweep_cells

    tsp32, tsp64, tp32, tp64 = (c.id for c in sweep_cells(MINI)[0])
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / f"{tsp32}.json").mkdir()
    (runs / f"{tsp64}.json").write_text("[" * 100_000 + "]" * 100_000)
    (runs / f"{tp32}.json").write_text(json.dumps([{"status": "ok"}]))
    header = sweep_cells(MINI)[0][0].spec.header("local", 2)  # tsp at S = 32, in tp's place
    record = {**header, "status": "error", "error_message": "x", "timestamp_utc": "now"}
    (runs / f"{tp64}.json").write_text(json.dumps(record))
    p = tspbench(
        "aggregate",
        "--config-json",
        json.dumps(MINI),
        "--runs",
        runs,
        "--csv",
        tmp_path / "s.csv",
        "--filtered",
        tmp_path / "f.csv",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    df = pd.read_csv(tmp_path / "s.csv").set_index("cell")
    assert (df["status"] == "corrupt").all(), df["error_message"].tolist()
    assert "record of strategy='tsp'" in df.loc[tp64, "error_message"]


# -- E: regress ------------------------------------------------------------------------------------


def _table(**columns) -> pd.DataFrame:
    cells = [f"{s}.D2.g2.S{S}.B1.train" for s in ("tsp", "tp") for S in (256, 1024)]
    base = {"status": "ok", "param_numel": 57664, "tokens_per_s_per_gflops": 40.0}
    return pd.DataFrame({"cell": cells, **base, **columns})


def _tolerances(tmp_path: Path, tolerance: float) -> Path:
    path = tmp_path / "tol.yaml"
    rule = {"tolerance": tolerance, "worse": "lower"}
    path.write_text(
        yaml.safe_dump({"exact": ["param_numel"], "relative": {"tokens_per_s_per_gflops": rule}})
    )
    return path


REGRESS = [  # (current table, tolerance, exit code, text in stdout or stderr)
    ("missing-column", _table().drop(columns="tokens_per_s_per_gflops"), 0.25, 2, "no tokens_per"),
    ("not-a-number", _table(tokens_per_s_per_gflops="fast"), 0.25, 2, "'fast' is not a number"),
    ("nan-tolerance", _table(tokens_per_s_per_gflops=20.0), math.nan, 2, "nan is not a finite"),
    ("negative-tolerance", _table(tokens_per_s_per_gflops=20.0), -1, 2, "-1 is less than"),
    ("inf-throughput", _table(tokens_per_s_per_gflops=[40, math.inf, 40, 40]), 0.25, 1, "corrupt"),
]


@pytest.mark.parametrize(
    "current, tolerance, code, needle", [r[1:] for r in REGRESS], ids=[r[0] for r in REGRESS]
)
def test_regress_exit_codes_mean_what_they_say(tmp_path, current, tolerance, code, needle):
    """2: unusable input (one line, no traceback); 1: a regression, and a NaN or infinite
    throughput is one (never an improvement)."""
    _table().to_csv(tmp_path / "base.csv", index=False)
    current.to_csv(tmp_path / "cur.csv", index=False)
    tol = _tolerances(tmp_path, tolerance)
    p = tspbench(
        "regress", "--baseline", tmp_path / "base.csv", "--current", tmp_path / "cur.csv",
        "--tolerances", tol,
    )  # fmt: skip
    assert p.returncode == code, p.stdout[-2000:] + p.stderr[-3000:]
    assert "Traceback" not in p.stderr and needle in p.stdout + p.stderr, p.stderr[-3000:]
    if code == 2:
        assert p.stderr.count("\n") == 1, p.stderr


def test_regress_update_changes_neither_file_when_one_cannot_be_written(tmp_path):
    (tmp_path / "b.csv").write_text("old baseline\n")
    (tmp_path / "b.json").mkdir()  # the provenance cannot be replaced
    _table().to_csv(tmp_path / "cur.csv", index=False)
    p = tspbench(
        "regress", "--update", "--current", tmp_path / "cur.csv", "--baseline", tmp_path / "b.csv",
        "--tolerances", _tolerances(tmp_path, 0.25),
    )  # fmt: skip
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert (tmp_path / "b.csv").read_text() == "old baseline\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["b.csv", "b.json", "cur.csv", "tol.yaml"]
