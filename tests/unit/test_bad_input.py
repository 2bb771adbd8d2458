"""Bad input is refused in-process with exit 2 and one line naming the field, value and rule;
nothing is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.helpers.runner import ROOT

RUN = ["run", "--strategy", "tsp", "--seq-len", "32"]


OK_CONFIG = yaml.safe_load((ROOT / "workflows/config/default.yaml").read_text())


def cfg_with(**top) -> str:
    return yaml.safe_dump({**OK_CONFIG, **top})


def sweep_with(**kw) -> str:
    c = json.loads(json.dumps(OK_CONFIG))
    c["sweeps"][0].update(kw)
    return yaml.safe_dump(c)


TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
TORCHRUN1 = {**TORCHRUN, "WORLD_SIZE": "1"}
SLURM = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "node1"}
S32 = ["--seq-len", "32"]

OK_RECORD = {
    "strategy": "tsp", "model": "tiny", "seq_len": 64, "degree": 2, "tp": 1, "sp": 1, "dp": 1,
    "world_size": 2, "mode": "train", "batch": 1, "dtype": "fp32", "status": "ok",
    "timestamp_utc": "2026-12-02T00:00:00Z", "peak_mem_bytes": 1000,
    "peak_mem_bytes_per_rank": [1000, 990], "peak_mem_bytes_first_step": 1100, "step_time_s": 0.1,
    "tokens_per_s": 640.0, "comm_bytes": {"all_gather": 10.0}, "flops_per_step": 10**6,
    "loss": 4.2, "grad_norm": 1.0, "hardware": {}, "versions": {}, "git_commit": None,
}  # fmt: skip


def record_with(**kw) -> str:
    return json.dumps({**OK_RECORD, **kw})


BAD = [
    ("run", ["--seq-len", "0"], {}, "--seq-len: '0': must be between 1 and"),
    ("run", ["--seq-len", "-5"], {}, "--seq-len: '-5': must be between"),
    ("run", ["--seq-len", "1.5"], {}, "--seq-len: '1.5': must be an integer"),
    ("run", ["--seq-len", "99999999999"], {}, "must be between 1 and 16777216"),
    ("run", ["--degree", "0"], {}, "--degree: '0': must be between 1"),
    ("run", ["--degree", "3", "--seq-len", "48"], {}, "model.heads=8: must be divisible by D"),
    ("run", ["--seq-len", "36", "--degree", "4"], {}, "seq_len=36: must be divisible by 2*D=8"),
    ("run", ["--strategy", "zero"], {}, "argument --strategy: invalid choice: 'zero'"),
    ("run", ["--model", "13b"], {}, "model='13b': unknown preset"),
    ("run", ["--model", "tiny; rm -rf /"], {}, "model='tiny; rm -rf /': no such config.json"),
    ("run", ["--set", "bogus=1"], {}, "--set 'bogus': unknown model field"),
    ("run", ["--set", "heads=x"], {}, "--set heads='x': must be an integer"),
    ("run", ["--set", "heads"], {}, "--set 'heads': expected field=value"),
    ("run", ["--set", "kv_heads=3"], {}, "model.kv_heads=3: must divide model.heads=8"),
    ("run", ["--tp", "2"], {}, "--tp/--sp: only strategy tpsp takes them"),
    (
        "run",
        ["--strategy", "tpsp", "--tp", "2", "--sp", "2", "--degree", "2"],
        {},
        "tp=2 x sp=2 = 4: must equal degree=2",
    ),
    (
        "run",
        ["--strategy", "dp", "--degree", "4", "--batch", "3"],
        {},
        "batch=3: must be divisible by degree=4",
    ),
    (
        "run",
        ["--degree", "2", "--launch", "local", "--nproc", "3"],
        {},
        "--nproc=3: must equal degree x dp x pp = 2",
    ),
    ("run", ["--degree", "2"], {}, "no launcher environment"),
    (
        "run",
        ["--degree", "2"],
        {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"},
        "world size 3 (from torchrun): must equal degree x dp x pp = 2",
    ),
    (
        "run",
        ["--degree", "2"],
        {"RANK": "0", "WORLD_SIZE": "2"},
        "RANK/WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not",
    ),
    (
        "run",
        ["--degree", "2"],
        {"SLURM_PROCID": "x", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"},
        "environment SLURM_PROCID='x': must be an integer",
    ),
    ("run", ["--max-memory", "lots"], {}, "--max-memory: 'lots': expected a size"),
    ("run", ["--max-memory", "0"], {}, "--max-memory: '0': must be positive"),
    ("run", ["--timeout", "-1"], {}, "--timeout: '-1': must be between 1 and 604800 seconds"),
    ("run", ["--timeout", "nan"], {}, "--timeout: 'nan': must be between 1 and 604800"),
    ("run", ["--timeout", "1e-9"], {}, "--timeout: '1e-9': must be between 1 and 604800"),
    ("run", ["--kv-bucket", "3"], {}, "kv_bucket=3: must divide the KV heads per head group"),
    ("run", ["--mode", "serve"], {}, "argument --mode: invalid choice: 'serve'"),
    ("run", ["--dtype", "fp8"], {}, "argument --dtype: invalid choice: 'fp8'"),
    ("run", ["--steps", "0"], {}, "--steps: '0': must be between 1 and 1000"),
    ("run", ["--warmup", "-1"], {}, "--warmup: '-1': must be between 0 and 1000"),
    ("out", "runs/record.txt", {}, "must name a .json file"),
    ("config", "sweeps: [unclosed\n", {}, "not valid YAML"),
    ("config", "", {}, "must be a mapping of settings, got NoneType"),
    ("config", sweep_with(strategies=["tsp", "zero"]), {}, "sweeps.0.strategies.1: 'zero'"),
    ("config", sweep_with(seq_lens=[1001]), {}, "sweeps[0].seq_lens: 1001 must be divisible"),
    ("config", sweep_with(gpus=[6]), {}, "sweeps[0].gpus: 6 must be a multiple of"),
    ("config", sweep_with(gpus=[0]), {}, "sweeps.0.gpus.0: 0 is less than the minimum of 1"),
    ("config", sweep_with(batches=[2.5]), {}, "sweeps.0.batches.0: 2.5 is not of type"),
    ("config", cfg_with(steps=0), {}, "steps: 0 is less than the minimum of 1"),
    ("config", cfg_with(name="x; rm -rf /"), {}, "name: 'x; rm -rf /' does not match"),
    ("config", cfg_with(model_overrides={"ffn": "4; rm"}), {}, "model_overrides.ffn: '4; rm'"),
    ("config", cfg_with(surprise=1), {}, "Additional properties are not allowed ('surprise'"),
    ("config", cfg_with(launcher="ssh"), {}, "launcher: 'ssh' is not one of"),
    ("config", cfg_with(max_memory="$(reboot)"), {}, "max_memory: '$(reboot)' does not match"),
    ("record", '{"status": "ok", ', {}, "not readable JSON"),
    ("record", json.dumps({"status": "fine"}), {}, "is a required property"),
    ("summary", "missing.csv", {}, "--summary='"),
    # launcher variables, checked before anything waits on a peer
    ("run", ["--degree", "2"], {**TORCHRUN, "RANK": "2"}, "rank 2 of world size 2"),
    ("run", S32, {**TORCHRUN1, "MASTER_PORT": "x"}, "MASTER_PORT='x': must be an integer"),
    ("run", S32, {**TORCHRUN1, "MASTER_PORT": "70000"}, "between 1 and 65535"),
    ("run", S32, {**TORCHRUN1, "LOCAL_RANK": "a"}, "LOCAL_RANK='a': must be an integer"),
    ("run", S32, {**TORCHRUN1, "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE='0'"),
    ("run", S32, {**TORCHRUN1, "TSPBENCH_LAUNCHER": "slurm"}, "TSPBENCH_LAUNCHER='slurm'"),
    ("run", S32, {**SLURM, "SLURM_JOB_NODELIST": "n[1-"}, "'n[1-': not a Slurm node list"),
    ("run", S32, {**SLURM, "SLURM_PROCID": "-1"}, "SLURM_PROCID='-1': must be between"),
    # inputs that would exhaust the machine
    ("run", ["--launch", "local", "--dp", "65536"], {}, "--launch local starts at most"),
    (
        "run",
        ["--degree", "2", "--launch", "local"],
        {"TSPBENCH_RANK_START": "exec"},
        "TSPBENCH_RANK_START='exec': must be fork or spawn",
    ),  # fmt: skip
    ("run", ["--set", "vocab=2000000000"], {}, "model.vocab=2000000000: must be between 1"),
    ("run", ["--set", "init_std=inf"], {}, "model.init_std=inf: must be between"),
    ("run", ["--set", "init_std=nan"], {}, "model.init_std=nan: must be between"),
    ("run", ["--batch", "4096", "--seq-len", "16777216"], {}, "GiB available"),
    ("run", ["--strategy", "single", "--seq-len", "16777216"], {}, "and the model's peak"),
    ("record", '{"status": "ok", "loss": NaN}', {}, "non-finite number NaN"),
    ("run", ["--device", "cuda"], {}, "--device=cuda: no GPU is visible"),
    # a strategy's own options: another strategy has none of them, whatever the value (even
    # the default: `tp --kv-bucket 2` was recorded as if it meant something, issue 35)
    (
        "run",
        ["--strategy", "tp", "--degree", "2", "--mlp-schedule", "broadcast"],
        {},
        "--mlp-schedule: strategy tp takes no such option (tsp takes it)",
    ),
    ("run", ["--strategy", "tp", "--kv-bucket", "2"], {}, "--kv-bucket: strategy tp takes no"),
    ("run", ["--strategy", "dp", "--overlap", "on"], {}, "--overlap: strategy dp takes no such"),
    ("run", ["--mlp-schedule", "tree"], {}, "argument --mlp-schedule: invalid choice: 'tree'"),
    ("run", ["--overlap", "maybe"], {}, "argument --overlap: 'maybe': must be on or off"),
    (
        "run",
        ["--strategy", "sp", "--degree", "2", "--kv-backward", "save"],
        {},
        "--kv-backward: strategy sp takes no such option (tsp takes it)",
    ),
    ("config", sweep_with(options={"mlp_schedule": "tree"}), {}, "options.mlp_schedule: mlp_sc"),
    ("config", sweep_with(options={"colour": "red"}), {}, "options.colour: no strategy has this"),
    ("config", cfg_with(mlp_schedule="ring"), {}, "Additional properties are not allowed"),
    # an ok record whose numbers cannot be measurements
    ("record", record_with(tokens_per_s=-5), {}, "tokens_per_s: -5 is less than or equal"),
    ("record", record_with(peak_mem_bytes=-1), {}, "peak_mem_bytes: -1 is less than the minimum"),
    ("record", record_with(step_time_s=0), {}, "step_time_s: 0 is less than or equal to the min"),
    ("record", record_with(mode="decode"), {}, "'new_tokens' is a required property"),
    ("record", record_with(mode="decode", new_tokens=8), {}, "'prefill_time_s' is a required"),
    ("record", record_with(schema_version=2), {}, "schema_version: 1 was expected"),
    (
        "run",
        ["--mode", "decode", "--recompute", "full"],
        {},
        "recompute='full': --mode decode runs",
    ),
    # plan: the ranges of run (a plan whose run line exits 2 is no plan)
    (
        "argv",
        [
            "plan",
            "--model",
            "7b",
            "--hardware",
            "h100",
            "--seq-len",
            "16384",
            "--gpus",
            "8",
            "--mode",
            "decode",
            "--new-tokens",
            "100000",
        ],
        {},
        "--new-tokens: '100000': must be between 2 and 65536",
    ),  # fmt: skip
    # estimate: the cap of 'fits' is checked before the estimate runs (and writes)
    ("estimate", ["--device-memory", "nan"], {}, "'nan': must be above 0 and at most 65536 GiB"),
    ("estimate", ["--device-memory", "-5"], {}, "'-5': must be above 0 and at most 65536 GiB"),
    ("estimate", ["--hardware", "a100"], {}, "--hardware='a100': must be one of h100, h200"),
]


@pytest.mark.parametrize(
    "kind, value, env, needle", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)]
)
def test_bad_input_exits_2_naming_the_problem(
    tmp_path, capsys, monkeypatch, kind, value, env, needle
):
    from tspbench.cli import main

    for var in (
        "RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_JOB_NODELIST",
        "SLURM_STEP_NODELIST",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
    ):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "out.json"
    if kind == "run":
        args = [*RUN, *value] if value[0] != "--strategy" else ["run", "--seq-len", "32", *value]
        if "--seq-len" in value:  # the case's own length replaces the default
            i = args.index("--seq-len")
            del args[i : i + 2]
        argv = [*args, "--out", str(out)]
    elif kind == "out":
        out = tmp_path / value
        argv = [*RUN, "--out", str(out)]
    elif kind == "config":
        path = tmp_path / "cfg.yaml"
        path.write_text(value)
        argv = ["check-config", str(path)]
    elif kind == "argv":
        argv = value
    elif kind == "estimate":
        argv = ["estimate", "--model", "tiny", "--strategy", "tsp", "--seq-len", "256", *value]
        argv += ["--out", str(out)]
    elif kind == "record":
        path = tmp_path / "rec.json"
        path.write_text(value)
        argv = ["check-record", str(path)]
    else:
        out = tmp_path / "tables"
        argv = ["tables", "--summary", str(tmp_path / value), "--out", str(out)]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2, err
    assert len(lines) == 1 and needle in lines[0], err
    assert not out.exists()


def test_at_least_thirty_bad_inputs():
    assert len(BAD) >= 30


TOO_LONG = "cannot write there (File name too long)"


@pytest.mark.parametrize(
    "make, extra, needle",
    [
        (lambda d: (d / "rec.json").mkdir() or d / "rec.json", [], "is a directory"),
        (lambda d: (d / "f").write_text("") or d / "f" / "rec.json", [], "is not a directory"),
        (lambda d: d / ("r" * 300 + ".json"), [], TOO_LONG),
        # the name fits, the atomic write's temporary file (14 characters more) does not
        (lambda d: d / ("r" * 245 + ".json"), [], TOO_LONG),
        # a pipeline cell's interrupted record (12 more) and its temporary file do not
        (lambda d: d / ("r" * 235 + ".json"), ["--cell"], TOO_LONG),
        (lambda d: Path("/sys/tspbench-rec.json"), [], "cannot write there ("),  # EACCES or EROFS
    ],
    ids=["directory", "parent-is-a-file", "name-too-long", "temporary-too-long",
         "interrupted-too-long", "read-only-file-system"],
)  # fmt: skip
def test_an_output_that_cannot_be_written_is_refused_before_the_run(
    tmp_path, capsys, make, extra, needle
):
    from tspbench.cli import main

    out = make(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main([*RUN, *extra, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_the_overlap_benchmark_takes_any_strategy_that_overlaps(tmp_path, capsys):
    """What TSP's prefetch gets measured, FSDP+CP's does too; TP overlaps nothing, and is told
    so before anything runs."""
    from tspbench.cli import main
    from tspbench.core.config import get_config
    from tspbench.runtime.comm_hiding import check_hides
    from tspbench.runtime.spec import RunSpec

    for s in ("tsp", "fsdp_cp"):
        check_hides(RunSpec.make(s, get_config("tiny"), degree=2, seq_len=64))
    out = tmp_path / "o.json"
    argv = ["overlap", "--strategy", "tp", "--degree", "2", "--seq-len", "32", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--strategy=tp: overlaps none of its collectives" in err[0], err
    assert not out.exists()


@pytest.mark.parametrize(
    "error, code, needle",
    [
        (
            RuntimeError("boom\nsecond line"),
            1,
            "tspbench model: unexpected RuntimeError: boom (run",
        ),
        (
            PermissionError(13, "Permission denied", "/ro/x.json"),
            2,
            "Permission denied: /ro/x.json",
        ),
    ],
)
def test_an_unforeseen_error_is_one_line_and_debug_shows_the_traceback(
    monkeypatch, capsys, error, code, needle
):
    """Whatever no check foresaw reaches the user as one line (exit 1; a path's OSError exit 2),
    with a pointer to --debug, which re-raises it."""
    import tspbench.cli.scale as scale
    from tspbench.cli import main

    def fail(args):
        raise error

    monkeypatch.setattr(scale, "cmd_model", fail)
    assert main(["model", "--model", "tiny", "--strategy", "tsp", "--seq-len", "64"]) == code
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and needle in err[0], err
    with pytest.raises(type(error)):
        main(["--debug", "model", "--model", "tiny", "--strategy", "tsp", "--seq-len", "64"])


PLAN = ["plan", "--hardware", "h100", "--seq-len", "1024", "--gpus", "8"]


@pytest.mark.parametrize(
    "argv, needle",
    [
        ([*PLAN, "--model", "{fifo}"], "--model='{fifo}': not a regular file"),
        ([*PLAN, "--model", "/dev/zero"], "--model='/dev/zero': not a regular file"),
        ([*PLAN, "--model", "{deep}"], "not valid JSON (maximum recursion depth"),
        (["plan", "--model", "tiny", "--seq-len", "1024", "--gpus", "8", "--hardware", "{fifo}"],
         "--hardware='{fifo}': not a regular file"),
        (["regress", "--baseline", "{fifo}", "--current", "{fifo}", "--tolerances", "{tol}"],
         "--current='{fifo}': not a regular file"),
        (["tables", "--summary", "{binary}", "--out", "{out}"], "'{binary}': not a text file"),
        (["check-record", "{fifo}"], "record '{fifo}': not a regular file"),
    ],
)  # fmt: skip
def test_readers_refuse_what_would_hang_or_eat_memory(tmp_path, capsys, argv, needle):
    """Every JSON, CSV and YAML input goes through one guarded reader: a FIFO would block for
    ever, /dev/zero read until memory runs out, deep JSON overflow the parser's stack."""
    import os

    from tspbench.cli import main

    names = {
        "fifo": tmp_path / "in.json",
        "deep": tmp_path / "deep.json",
        "binary": tmp_path / "bin.csv",
        "out": tmp_path / "out",
        "tol": ROOT / "workflows/regress.yaml",
    }
    os.mkfifo(names["fifo"])
    names["deep"].write_text("[" * 100_000)
    names["binary"].write_bytes(bytes(range(256)) * 4)
    fill = {k: str(v) for k, v in names.items()}
    code = main([a.format(**fill) for a in argv])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert code == 2 and len(err) == 1 and needle.format(**fill) in err[0], err
    assert not names["out"].exists()


PROJECT = ["project", "--strategy", "tsp", "--model", "7b", "--seq-len", "16384", "--degree", "8"]
OUTPUTS = [  # (command before its output option, option, what it writes)
    (PROJECT, "--out", "file.json"),
    (["plan", "--model", "7b", "--seq-len", "16384", "--gpus", "8"], "--out", "file.json"),
    (["claims"], "--out", "file"),
    (["claims"], "--md", "file"),
    (["regress", "--current", "x.csv"], "--out", "file"),
    (["project-check", "--published"], "--out", "file"),
    (["calibrate"], "--out", "file.json"),
    (["doctor"], "--out", "dir"),
    (["gpu-check"], "--out", "dir"),
    (["tables", "--summary", "x.csv"], "--out", "dir"),
    (["plan-map", "--model", "7b", "--hardware", "h100"], "--out", "dir"),
    (["projected-report", "--estimates", "e", "--plots", "p"], "--out", "dir"),
]


@pytest.mark.parametrize("argv, opt, kind", OUTPUTS, ids=[f"{a[0]}{o}" for a, o, _ in OUTPUTS])
@pytest.mark.parametrize("bad", ["folder-or-file", "under-a-file", "read-only"])
def test_every_command_probes_its_outputs_before_any_work(tmp_path, capsys, argv, opt, kind, bad):
    """Issue 35: claims, plan, doctor and projected-report --out naming a folder, a file or a
    read-only mount ran the whole computation first, then died with a traceback."""
    import time

    from tspbench.cli import main

    (tmp_path / "f").write_text("")
    if bad == "folder-or-file":  # a folder where a file goes, a file where a folder goes
        out = tmp_path / "f" if kind == "dir" else tmp_path
    elif bad == "under-a-file":
        out = tmp_path / "f" / ("x.json" if kind.endswith(".json") else "x")
    else:
        out = Path("/sys/tspbench-out") / ("x.json" if kind.endswith(".json") else "")
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        main([*argv, opt, str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and f"argument {opt}:" in err, err
    assert time.monotonic() - t0 < 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]
