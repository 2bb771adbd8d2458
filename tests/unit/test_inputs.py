"""Inputs that used to pass every check and then fail (or lie) later are refused where they enter,
with exit 2 and one line naming the field, the value and the rule: sweep configs (check-config),
tolerances and tables (regress), run records (aggregate) and caption notes (tables). Each case
is a real file on disk read through the command line's entry point, in-process."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tests.helpers.configs import MINI
from tests.helpers.runner import ROOT
from tspbench.cli import main
from tspbench.pipeline.cells import sweep_cells
from tspbench.runtime.local import max_local_ranks
from tspbench.runtime.registry import schema

DEFAULT = yaml.safe_load((ROOT / "workflows/config/default.yaml").read_text())
TOL = yaml.safe_load((ROOT / "workflows/regress.yaml").read_text())


def config_with(sweep: dict | None = None, **top) -> dict:
    cfg = json.loads(json.dumps(DEFAULT))
    cfg["sweeps"][0].update(sweep or {})
    return {**cfg, **top}


ALL_FILTERED = {"strategies": ["tp"], "degrees": [3], "gpus": [3], "seq_lens": [6], "tpsp": []}


def exit_line(capsys, argv: list[str]) -> tuple[int, str]:
    """Exit code and stderr of ``tspbench argv`` (stderr must be one line when it is an error)."""
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


# -- B, F: sweep configs ------------------------------------------------------------------------

OVER_CAP = 8 * (max_local_ranks() // 8 + 1)
BAD_CONFIGS = [
    ("timeout-nan", config_with(timeout=math.nan), "timeout: nan is not a finite number"),
    ("timeout-tiny", config_with(timeout=1e-9), "timeout: 1e-09 is less than the minimum of 1"),
    ("timeout-week", config_with(timeout=604801), "timeout: 604801 is greater than the maximum"),
    ("seed", config_with(seed=2**31), "seed: 2147483648 is greater than the maximum of 2147483647"),
    ("max-memory-0", config_with(max_memory="0"), "max_memory: '0' does not match"),
    ("max-memory-0.5", config_with(max_memory="0.5"), "max_memory: '0.5': must be positive"),
    ("warmup-float", config_with(warmup=2.0), "warmup: 2.0 is not of type 'integer'"),
    ("steps-float", config_with(steps=3.0), "steps: 3.0 is not of type 'integer'"),
    ("degrees-float", config_with({"degrees": [4.0]}), "sweeps.0.degrees.0: 4.0 is not of type"),
    ("gpus-float", config_with({"gpus": [4.0]}), "sweeps.0.gpus.0: 4.0 is not of type"),
    ("seq-float", config_with({"seq_lens": [512.0]}), "sweeps.0.seq_lens.0: 512.0 is not of type"),
    ("tpsp-float", config_with({"tpsp": [[2.0, 2]]}), "sweeps.0.tpsp.0.0: 2.0 is not of type"),
    ("vocab", config_with(model_overrides={"vocab": 2**20 + 1}), "model_overrides.vocab: 1048577"),
    ("hidden", config_with(model_overrides={"hidden": 65537}), "model_overrides.hidden: 65537"),
    ("layers", config_with(model_overrides={"layers": 1025}), "model_overrides.layers: 1025"),
    ("heads", config_with(model_overrides={"heads": 1025}), "model_overrides.heads: 1025"),
    ("kv-heads", config_with(model_overrides={"kv_heads": 1025}), "model_overrides.kv_heads"),
    ("ffn", config_with(model_overrides={"ffn": 2**20 + 1}), "model_overrides.ffn: 1048577"),
    ("ffn-float", config_with(model_overrides={"ffn": 256.0}), "ffn: 256.0 is not of type"),
    ("init-std-nan", config_with(model_overrides={"init_std": math.nan}), "init_std: nan"),
    (
        "init-std-0",
        config_with(model_overrides={"init_std": 0}),
        "init_std: 0 is less than the minimum of 1e-06",
    ),
    ("init-std-11", config_with(model_overrides={"init_std": 11}), "init_std: 11 is greater"),
    (
        "norm-eps-1",
        config_with(model_overrides={"norm_eps": 1}),
        "norm_eps: 1 is greater than the maximum of 0.1",
    ),
    ("rope-inf", config_with(model_overrides={"rope_theta": math.inf}), "rope_theta: inf is not"),
    ("rope-big", config_with(model_overrides={"rope_theta": 2e9}), "rope_theta: 2000000000.0"),
    ("name-dotdot", config_with(name=".."), "name: '..' does not match"),
    ("name-dot", config_with(name="."), "name: '.' does not match"),
    ("runtime", config_with(runtime_minutes=10**6), "runtime_minutes: 1000000 is greater"),
    ("dup", config_with({"seq_lens": [256, 256]}), "sweeps.0.seq_lens: [256, 256] has non-unique"),
    ("long", config_with({"batches": list(range(1, 66))}), "sweeps.0.batches: [1, 2, 3,"),
    (
        "all-filtered",  # TP at D = 3 cannot split the tiny model's 8 heads
        {**DEFAULT, "sweeps": [{**DEFAULT["sweeps"][0], **ALL_FILTERED}]},
        "no runnable cell: all 1 combinations are filtered (model.heads=8",
    ),
    (
        "local-cap",  # a multiple of every degree, above what this machine's launcher starts
        config_with({"gpus": [OVER_CAP]}),
        f"sweeps[0].gpus: {OVER_CAP}: launcher local starts at most {max_local_ranks()} ranks",
    ),
    # pipelined sweeps: whole stages of model groups, schedule settings only with stages
    (
        "pp-gpus",
        config_with({"pp": 2}),
        "sweeps[0].gpus: 4 must be a multiple of the model group D = 4 x pp = 8",
    ),  # fmt: skip
    (
        "pp-alone",
        config_with({"microbatches": 2}),
        "sweeps[0].pp_schedule, microbatches: only with sweeps[0].pp > 1",
    ),  # fmt: skip
    ("pp-schedule", config_with({"pp": 2, "pp_schedule": "zbv"}), "sweeps.0.pp_schedule: 'zbv'"),
    # a sweep's own model: the model's rules, and never one id for two models
    (
        "sweep-top-k",
        config_with({"model_overrides": {"experts": 8, "top_k": 9}}),
        "sweeps[0].model_overrides: model.top_k=9: must be between 1 and model.experts=8",
    ),  # fmt: skip
    ("sweep-float", config_with({"model_overrides": {"experts": 8.0}}), "experts: 8.0 is not"),
    (
        "sweep-collides",  # sweep 0's S = 512 cells (on 3 layers) are sweep 5's (on 2)
        config_with({"model_overrides": {"layers": 3}}),
        "sweeps[5] ('seq'): cell fsdp_cp.D4.g4.S512.B1.train has another model than sweep "
        "'seq''s cell of that id",
    ),  # fmt: skip
    (
        "too-many",
        config_with(
            {"gpus": [4 * i for i in range(1, 41)], "seq_lens": [8 * i for i in range(1, 41)]}
        ),
        "combinations, more than 10000: split the sweep",
    ),
]


@pytest.mark.parametrize(
    "config, needle", [b[1:] for b in BAD_CONFIGS], ids=[b[0] for b in BAD_CONFIGS]
)
def test_check_config_refuses_values_that_would_fail_every_cell(tmp_path, capsys, config, needle):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    code, err = exit_line(capsys, ["check-config", str(path)])
    assert code == 2, err
    assert needle in err and err.count("\n") == 1, err


def test_a_300_by_300_sweep_is_refused_in_well_under_a_second(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text(
        yaml.safe_dump(
            config_with({"gpus": list(range(4, 1204, 4)), "seq_lens": list(range(8, 2408, 8))})
        )
    )
    start = time.monotonic()
    code, err = exit_line(capsys, ["check-config", str(path)])
    assert code == 2 and "is too long" in err and err.count("\n") == 1, err
    assert time.monotonic() - start < 5


def test_yaml_aliases_are_refused(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    text = yaml.safe_dump(DEFAULT).replace("seed: 0", "seed: &s 0") + "note: *s\n"
    path.write_text(text)
    code, err = exit_line(capsys, ["check-config", str(path)])
    assert code == 2 and "YAML alias *s: aliases are not allowed" in err, err


def test_shipped_configs_stay_valid(capsys):
    for name in ("default", "ci", "paper"):
        assert main(["check-config", str(ROOT / f"workflows/config/{name}.yaml")]) == 0
    from tspbench.pipeline.projected import load

    assert load(str(ROOT / "workflows/config/projected.yaml"))["model"] == "7b"


def test_a_sweeps_options_go_to_the_strategies_that_declare_them():
    """``options`` of a sweep reach the cells of the strategies that declare each (TSP's MLP
    schedule and K/V backward: its ids say so); the others run as before, ids unchanged."""
    from tspbench.pipeline.cells import sweep_cells

    sweep = {
        "name": "o",
        "strategies": ["tsp", "tp", "fsdp_cp"],
        "degrees": [2],
        "gpus": [2],
        "seq_lens": [64],
        "batches": [1],
        "modes": ["train"],
        "options": {"mlp_schedule": "broadcast", "kv_backward": "save", "overlap": False},
    }
    cells, filtered = sweep_cells({**DEFAULT, "sweeps": [sweep]})  # fmt: skip
    assert not filtered
    by = {c.spec.strategy: c.spec for c in cells}
    assert by["tsp"].id == "tsp-overlap-off-mlp-broadcast-kvsave.D2.g2.S64.B1.train"
    assert by["fsdp_cp"].label == "fsdp_cp (overlap off)"
    assert by["tp"].id == "tp.D2.g2.S64.B1.train" and dict(by["tp"].options) == {}
    assert by["fsdp_cp"].options["overlap"] is False and by["tsp"].options["overlap"] is False
    assert "--overlap off" in " ".join(by["fsdp_cp"].to_argv())


# -- B: the schema and the CLI share one set of ranges -------------------------------------------

SCHEMA = schema("config.schema.yaml")
SWEEP = SCHEMA["properties"]["sweeps"]["items"]["properties"]
SHARED = [  # (schema bounds of a value, the tspbench run option that receives it)
    (SCHEMA["properties"]["warmup"], "--warmup"),
    (SCHEMA["properties"]["steps"], "--steps"),
    (SCHEMA["properties"]["seed"], "--seed"),
    (SCHEMA["properties"]["timeout"], "--timeout"),
    (SWEEP["seq_lens"]["items"], "--seq-len"),
    (SWEEP["degrees"]["items"], "--degree"),
    (SWEEP["tpsp"]["items"]["items"], "--tp"),
    (SWEEP["tpsp"]["items"]["items"], "--sp"),
    (SWEEP["gpus"]["items"], "--nproc"),
    (SWEEP["batches"]["items"], "--batch"),
]


def _cli_accepts(option: str, value: float) -> bool:
    import argparse

    from tspbench.cli import make_parser

    sub = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in sub.choices["run"]._actions if option in a.option_strings)
    try:
        action.type(repr(value) if isinstance(value, float) else str(value))
    except argparse.ArgumentTypeError:
        return False
    return True


@pytest.mark.parametrize("bounds, option", SHARED, ids=[s[1] for s in SHARED])
def test_schema_bounds_are_the_cli_bounds(bounds, option):
    """The largest value the schema allows is the CLI's largest; the smallest is one the CLI
    accepts (timeout alone is stricter: >= 1 s, where the CLI takes any positive number)."""
    lo, hi = bounds["minimum"], bounds["maximum"]
    assert _cli_accepts(option, hi) and not _cli_accepts(option, hi + 1), (option, hi)
    assert _cli_accepts(option, lo), (option, lo)
    if option != "--timeout":
        assert not _cli_accepts(option, lo - 1), (option, lo)


def test_model_override_bounds_are_the_model_configs():
    """--set and the model's own validation take their ranges from core.config.RANGES."""
    from tspbench.core.config import RANGES

    fields = SCHEMA["properties"]["model_overrides"]["properties"]
    flags = {"qk_norm", "qkv_bias", "o_bias", "mlp_bias", "tie_embeddings", "norm_topk"}
    assert set(fields) == set(RANGES) | flags | {"rope_scaling"}  # the fields not numbers
    assert fields["rope_scaling"]["type"] == "string"
    assert {fields[f]["type"] for f in flags} == {"boolean"}
    for name, (lo, hi) in RANGES.items():
        assert (fields[name]["minimum"], fields[name]["maximum"]) == (lo, hi), name
        assert fields[name]["type"] == ("number" if isinstance(lo, float) else "integer"), name


# -- D: run records --------------------------------------------------------------------------------


def record(cell, **changes) -> dict:
    """A valid ok record of ``cell``, as tspbench run writes it."""
    return {
        **cell.spec.header("local", cell.gpus),
        "status": "ok",
        "peak_mem_bytes": 1000,
        "peak_mem_bytes_per_rank": [1000, 900],
        "peak_mem_bytes_first_step": 900,
        "step_time_s": 0.1,
        "tokens_per_s": 320.0,
        "comm_bytes": {"broadcast": 10.0},
        "flops_per_step": 123,
        "loss": 5.5,
        "grad_norm": 2.0,
        "hardware": {"device_name": "cpu"},
        "versions": {},
        "git_commit": None,
        "timestamp_utc": "2026-01-01T00:00:00+00:00",
        **changes,
    }


def aggregate(tmp_path: Path, capsys, write) -> pd.DataFrame:
    """Records written by ``write(runs, cells)``, aggregated by ``tspbench aggregate``."""
    from tspbench.pipeline.cells import sweep_cells

    cells, _ = sweep_cells(MINI)
    runs = tmp_path / "runs"
    runs.mkdir()
    write(runs, cells)
    argv = ["aggregate", "--config-json", json.dumps(MINI), "--runs", str(runs)]
    argv += ["--csv", str(tmp_path / "s.csv"), "--filtered", str(tmp_path / "f.csv")]
    assert main(argv) == 0, capsys.readouterr().err
    return pd.read_csv(tmp_path / "s.csv").set_index("cell")


def test_malformed_records_become_corrupt_rows_never_another_cells_numbers(tmp_path, capsys):
    ids = []

    def write(runs: Path, cells) -> None:
        tsp32, tsp64, tp32, tp64 = cells  # MINI: tsp and tp at S = 32, 64
        ids.extend(c.id for c in cells)
        (runs / f"{tsp32.id}.json").mkdir()  # a directory where the record belongs
        (runs / f"{tsp64.id}.json").write_text(json.dumps(record(tp32)))  # another strategy's
        (runs / f"{tp32.id}.json").write_text("[" * 100_000 + "]" * 100_000)  # too deep to parse
        (runs / f"{tp64.id}.json").write_text(json.dumps(record(tp32)))  # another S's

    df = aggregate(tmp_path, capsys, write)
    assert list(df["status"]) == ["corrupt"] * 4, df["error_message"].tolist()
    assert "not a regular file" in df.loc[ids[0], "error_message"]
    assert (
        "record of strategy='tp', cell tsp.D2.g2.S64.B1.train has 'tsp'"
        in df.loc[ids[1], "error_message"]
    )
    assert "RecursionError" in df.loc[ids[2], "error_message"]
    assert (
        "record of seq_len=32, cell tp.D2.g2.S64.B1.train has 64" in df.loc[ids[3], "error_message"]
    )
    assert "tokens_per_s" not in df  # nobody's numbers in these rows


def test_records_that_break_the_schema_or_hold_nan_are_corrupt(tmp_path, capsys):
    ids = []

    def write(runs: Path, cells) -> None:
        ids.extend(c.id for c in cells)
        (runs / f"{cells[0].id}.json").write_text(json.dumps([record(cells[0])]))  # a list
        nan = json.dumps(record(cells[1], loss=math.nan))  # json writes NaN
        (runs / f"{cells[1].id}.json").write_text(nan)
        inf = json.dumps(record(cells[2], tokens_per_s=math.inf))
        (runs / f"{cells[2].id}.json").write_text(inf)
        error = record(cells[3], status="error", error_message="boom", loss=math.nan)
        (runs / f"{cells[3].id}.json").write_text(json.dumps(error))

    df = aggregate(tmp_path, capsys, write)
    assert list(df["status"]) == ["corrupt", "corrupt", "corrupt", "error"]
    assert "(top level): [" in df.loc[ids[0], "error_message"]
    assert "is not of type 'object'" in df.loc[ids[0], "error_message"]
    assert "loss: nan is not a finite number" in df.loc[ids[1], "error_message"]
    assert "tokens_per_s: inf is not a finite number" in df.loc[ids[2], "error_message"]


def test_a_good_record_still_fills_its_row(tmp_path, capsys):
    def write(runs: Path, cells) -> None:
        for c in cells:
            (runs / f"{c.id}.json").write_text(json.dumps(record(c)))

    df = aggregate(tmp_path, capsys, write)
    assert set(df["status"]) == {"ok"} and (df["tokens_per_s"] == 320.0).all()


def test_a_failed_parquet_write_leaves_no_temporary(tmp_path, capsys):
    from tspbench.pipeline.cells import sweep_cells

    runs = tmp_path / "runs"
    runs.mkdir()
    for c in sweep_cells(MINI)[0]:
        (runs / f"{c.id}.json").write_text(json.dumps(record(c)))
    parquet = tmp_path / "summary.parquet"
    parquet.mkdir()  # cannot be replaced by a file
    argv = ["aggregate", "--config-json", json.dumps(MINI), "--runs", str(runs)]
    argv += ["--csv", str(tmp_path / "s.csv"), "--parquet", str(parquet)]
    with pytest.raises(SystemExit) as e:  # refused as the arguments are read: no work done
        main([*argv, "--filtered", str(tmp_path / "f.csv")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --parquet:" in err and err.count("\n") == 1, err
    assert "is a directory" in err and not (tmp_path / "s.csv").exists()
    assert not list(tmp_path.glob(".summary.parquet*")), list(tmp_path.iterdir())


# -- E: regress ------------------------------------------------------------------------------------


def table() -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "cell": f"{s}.D2.g2.S{S}.B1.train",
                "status": "ok",
                "strategy": s,
                "comm_bytes_total": 1000.0 * S,
                "param_numel": 57664,
                "peak_mem_bytes": 1e6 + S,
                "tokens_per_s_per_gflops": 40.0,
                "device_name": "AMD EPYC",
            }
            for s in ("tsp", "tp")
            for S in (256, 1024)
        ]
    )


def regress(tmp_path: Path, capsys, current: pd.DataFrame | str | bytes, tol: dict | str = TOL):
    base, cur, tolf = tmp_path / "base.csv", tmp_path / "cur.csv", tmp_path / "tol.yaml"
    table().to_csv(base, index=False)
    if isinstance(current, pd.DataFrame):
        current.to_csv(cur, index=False)
    else:
        cur.write_bytes(current.encode() if isinstance(current, str) else current)
    tolf.write_text(tol if isinstance(tol, str) else yaml.safe_dump(tol))
    argv = ["regress", "--baseline", str(base), "--current", str(cur), "--tolerances", str(tolf)]
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def with_rule(section: str = "relative", **rule) -> dict:
    tol = json.loads(json.dumps(TOL))
    (tol["ab"] if section == "ab" else tol["relative"]["peak_mem_bytes"]).update(rule)
    return tol


@pytest.mark.parametrize(
    "tol, needle",
    [
        (with_rule(tolerance=math.nan), "peak_mem_bytes.tolerance: nan is not a finite"),
        (with_rule(tolerance=math.inf), "tolerance: inf is not a finite number"),
        (with_rule(tolerance=-0.1), "tolerance: -0.1 is less than the minimum of 0"),
        (with_rule("ab", cell_tolerance=math.nan), "ab.cell_tolerance: nan is not a finite"),
        (with_rule("ab", median_tolerance=-1), "median_tolerance: -1 is less than the minimum"),
        (with_rule(worse="sideways"), "worse: 'sideways' is not one of"),
        ({**TOL, "relative": {"peak_mem_bytes": {"worse": "higher"}}}, "'tolerance' is a"),
        ("exact: &e [param_numel]\nrelative: {x: {tolerance: 1, worse: lower, y: *e}}\n", "alias"),
    ],
    ids=["nan", "inf", "negative", "ab-nan", "ab-negative", "worse", "no-tolerance", "alias"],
)
def test_unusable_tolerances_exit_2_instead_of_disabling_the_gate(tmp_path, capsys, tol, needle):
    more = table().assign(peak_mem_bytes=2e6 + 1024)  # more memory everywhere
    code, _, err = regress(tmp_path, capsys, more, tol)
    assert code == 2 and needle in err and err.count("\n") == 1, err


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_non_finite_memory_is_corrupt_never_an_improvement(tmp_path, capsys, value):
    cur = table()
    cur.loc[1, "peak_mem_bytes"] = value
    code, out, _ = regress(tmp_path, capsys, cur)
    assert code == 1, out
    assert re.search(r"\| tsp.D2.g2.S1024.B1.train \| peak_mem_bytes \|.*\| corrupt \|", out)
    assert "improvement" not in out.split("\n", 1)[1]


@pytest.mark.parametrize(
    "current, needle",
    [
        (table().drop(columns="peak_mem_bytes"), "no peak_mem_bytes column"),
        (table().assign(param_numel="many"), "column param_numel: 'many' is not a number"),
        ("cell,status\ntsp,ok,1,2\n", "rows with more fields than the header"),
        (b"\xff\xfe\x00\xc3garbage\n", "not a text file"),
        ("cell,status\n,ok\n", "empty or duplicate cells"),
    ],
    ids=["missing-column", "not-a-number", "ragged", "binary", "no-cell"],
)
def test_malformed_tables_exit_2(tmp_path, capsys, current, needle):
    code, _, err = regress(tmp_path, capsys, current)
    assert code == 2 and needle in err and err.count("\n") == 1, err


def _update(tmp_path: Path, capsys) -> tuple[int, str]:
    cur = tmp_path / "new.csv"
    table().assign(tokens_per_s_per_gflops=50.0).to_csv(cur, index=False)
    argv = ["regress", "--update", "--current", str(cur), "--baseline", str(tmp_path / "b.csv")]
    code = main([*argv, "--tolerances", str(ROOT / "workflows/regress.yaml")])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("blocked", ["b.json", "b.csv"])
def test_update_writes_the_baseline_and_its_provenance_as_a_pair(tmp_path, capsys, blocked):
    """One of the pair cannot be replaced (a directory is in the way): neither file changes."""
    for name in ("b.csv", "b.json"):
        (tmp_path / name).write_text("old")
    (tmp_path / blocked).unlink()
    (tmp_path / blocked).mkdir()
    code, err = _update(tmp_path, capsys)
    assert code == 2 and "cannot write it" in err and err.count("\n") == 1, err
    other = "b.csv" if blocked == "b.json" else "b.json"
    assert (tmp_path / other).read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.csv", "b.json", "new.csv"]


def test_update_refuses_an_infinite_measurement(tmp_path, capsys):
    cur = tmp_path / "new.csv"
    table().assign(tokens_per_s_per_gflops=math.inf).to_csv(cur, index=False)
    argv = ["regress", "--update", "--current", str(cur), "--baseline", str(tmp_path / "b.csv")]
    code = main([*argv, "--tolerances", str(ROOT / "workflows/regress.yaml")])
    assert code == 2 and not (tmp_path / "b.csv").exists()


# -- F: LaTeX captions -----------------------------------------------------------------------------

SPECIAL = r"50%_of runs & $5 #1 {x} ~y ^z \end{table}"


def _latex_text_is_literal(text: str) -> bool:
    """No LaTeX special character outside an escape, and only the escapes latex_text writes."""
    rest = re.sub(r"\\(textbackslash|textasciitilde|textasciicircum)\{\}|\\[&%$#_{}]", "", text)
    return not re.search(r"[\\&%$#_{}~^]", rest)


def test_tables_note_is_escaped_in_latex_captions(tmp_path, capsys):
    rows = [
        {"cell": f"tsp.{S}", "sweep": "seq", "label": "tsp", "strategy": "tsp", "seq_len": S,
         "gpus": 4, "degree": 4, "batch": 1, "mode": "train", "status": "ok",
         "peak_mem_bytes": 1e6, "tokens_per_s": 1e3, "comm_bytes_total": 1e4}
        for S in (256, 512)
    ]  # fmt: skip
    summary = tmp_path / "summary.csv"
    pd.DataFrame(rows).to_csv(summary, index=False)
    assert (
        main(
            ["tables", "--summary", str(summary), "--out", str(tmp_path / "t"), f"--note={SPECIAL}"]
        )
        == 0
    )
    tex = (tmp_path / "t/tex/memory_vs_seq.tex").read_text()
    caption = re.search(r"\\caption\{(.*)\}\n", tex).group(1)
    assert _latex_text_is_literal(caption), caption
    assert r"50\%\_of runs \& \$5 \#1 \{x\} \textasciitilde{}y \textasciicircum{}z" in caption
    assert r"\textbackslash{}end\{table\}" in caption
    assert tex.count(r"\begin{table}") == 1 and tex.count(r"\end{table}") == 1


def test_a_pipelined_sweep_makes_pipelined_cells():
    """The default sweep's pipeline cells: TSP and TP at D = 2 in two stages on 4 ranks, each
    beside its model group without stages on 2 ranks with the same global batch."""
    cells, _ = sweep_cells(DEFAULT)
    staged = {c.spec.id: c for c in cells if c.spec.layout.pp > 1}
    assert set(staged) == {"tsp-pp2-1f1b-m4.D2.g4.S512.B4.train",
                           "tp-pp2-1f1b-m4.D2.g4.S512.B4.train"}  # fmt: skip
    for c in staged.values():
        assert c.gpus == c.spec.layout.world_size == 4 and c.spec.layout.dp == 1
        assert "--pp 2" in " ".join(c.spec.to_argv()) and c.sweeps == ("pipeline",)
    flat = {c.spec.id for c in cells if c.sweeps == ("pipeline",) and c.spec.layout.pp == 1}
    assert flat == {"tsp.D2.g2.S512.B4.train", "tp.D2.g2.S512.B4.train"}
