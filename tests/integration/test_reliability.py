"""Reliability: bad input is refused with exit 2 and a message naming the field (nothing
written), a killed or stalled rank cannot hang the others, signals leave a record, a sweep with a
failing and an OOM cell still finishes and says so, and the same seed gives the same loss."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tests.helpers.configs import MINI
from tests.helpers.runner import copy_workflow, snakemake, tspbench

RUN = ["run", "--strategy", "tsp", "--seq-len", "32"]


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its SigCgt mask)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(x for x in status.splitlines() if x.startswith("SigCgt:")).split()[1], 16)
    return bool(mask >> (sig - 1) & 1)


def wait_for_rank(marker: str, rank: int, timeout: float = 60) -> int:
    """The pid of local rank ``rank`` of the run writing ``marker``, once it has started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in leftovers(marker):
            pid = int(line.split()[0])
            try:  # a forked rank names itself; a spawned one has its own environment
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if comm == f"tspbench-r{rank}":
                return pid
            if f"RANK={rank}".encode() in env and b"TSPBENCH_LAUNCHER=local" in env:
                return pid
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} of {marker} never started")


def leftovers(marker: str) -> list[str]:
    """Processes whose command line names ``marker`` (full width: pytest sets COLUMNS, and a
    truncated line would hide a leftover rank)."""
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if marker in line and "ps -ww" not in line]


FAULT_RUN = [
    "run",
    "--strategy",
    "tsp",
    "--degree",
    "4",
    "--seq-len",
    "64",
    "--steps",
    "3",
    "--launch",
    "local",
    "--quiet",
]
TIMEOUT = 10


@pytest.fixture(scope="module")
def baseline_s(tmp_path_factory) -> float:
    """Wall time of the same run without a fault (start-up dominates on 2 cores)."""
    out = tmp_path_factory.mktemp("base") / "ok.json"
    t0 = time.monotonic()
    p = tspbench(*FAULT_RUN, "--out", str(out), "--timeout", str(TIMEOUT))
    assert p.returncode == 0, p.stderr[-2000:]
    return time.monotonic() - t0


@pytest.mark.parametrize(
    "fault, needle, start",
    [
        ("kill:rank=2:step=2", "rank 2 killed by SIGKILL", "fork"),
        ("kill:rank=2:step=2", "rank 2 killed by SIGKILL", "spawn"),  # a GPU build's ranks
        ("kill:rank=0:step=1", "rank 0 killed by SIGKILL", "fork"),
        ("stall:rank=1:step=1", "rank 1 hung", "fork"),
        ("error:rank=3:step=1", "injected fault", "fork"),
    ],
)
def test_a_dead_or_stalled_rank_ends_every_rank(tmp_path, baseline_s, fault, needle, start):
    out = tmp_path / "f.json"
    t0 = time.monotonic()
    env = {"TSPBENCH_FAULT": fault, "TSPBENCH_RANK_START": start}
    p = tspbench(*FAULT_RUN, "--out", str(out), "--timeout", str(TIMEOUT), env=env)
    took = time.monotonic() - t0
    rec = json.loads(out.read_text())
    assert p.returncode == 1 and rec["status"] == "error", rec
    assert needle in rec["error_message"], rec["error_message"]
    assert took < baseline_s + TIMEOUT + 10, (took, baseline_s)
    assert leftovers(str(out)) == []
    rank = int(fault.split("rank=")[1].split(":")[0])
    # a killed rank posts nothing: rank 0 names it as the silent one, or (rank 0 killed) the
    # launcher does, never a peer it killed for outliving it
    assert rec["failed_ranks"] == [rank], rec


def test_a_stopped_rank_zero_cannot_hang_the_launcher(tmp_path, baseline_s):
    """SIGSTOP rank 0 (a native hang holding the GIL looks the same): its heartbeat stops, so
    the launcher kills it after --timeout (or its peers give up first, after the same time and
    the launcher kills it when they have ended) and writes the record naming it."""
    out = tmp_path / "s.json"
    cmd = [sys.executable, "-m", "tspbench", *FAULT_RUN, "--out", str(out)]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [*cmd, "--timeout", str(TIMEOUT), "--steps", "50"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    rank0 = wait_for_rank(str(out), 0)
    time.sleep(2)  # into the run
    os.kill(rank0, signal.SIGSTOP)
    proc.wait(timeout=baseline_s + 4 * TIMEOUT + 30)
    rec = json.loads(out.read_text())
    named = ("rank 0 still running", "rank 0 stopped responding")
    assert rec["status"] == "error" and any(n in rec["error_message"] for n in named), rec
    assert rec["failed_ranks"] == [0], rec
    assert time.monotonic() - t0 < baseline_s + 2 * TIMEOUT + 20
    assert leftovers(str(out)) == []


def test_a_stopped_lone_rank_cannot_hang_the_launcher(tmp_path, baseline_s):
    """World size 1, no peer to time out: SIGSTOP the only rank mid-run. Its heartbeat stops,
    the launcher kills it once --timeout has passed without one and writes the record."""
    out = tmp_path / "lone.json"
    run = ["run", "--strategy", "single", "--seq-len", "256", "--steps", "1000"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tspbench", *run, "--launch", "local", "--out", str(out),
         "--timeout", str(TIMEOUT)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    rank0 = wait_for_rank(str(out), 0)
    time.sleep(2)  # into the run
    t0 = time.monotonic()
    os.kill(rank0, signal.SIGSTOP)
    try:
        code = proc.wait(timeout=TIMEOUT + 30)
    finally:
        proc.kill()
    rec = json.loads(out.read_text())
    assert code == 1 and rec["status"] == "error", rec
    assert "rank 0 stopped responding" in rec["error_message"], rec
    assert rec["failed_ranks"] == [0], rec
    assert TIMEOUT - 1 <= time.monotonic() - t0 < TIMEOUT + 15  # (the last beat: <= 0.5 s before)
    assert leftovers(str(out)) == []


def test_a_slow_healthy_step_is_not_a_hang_and_a_hung_one_says_which_limit(tmp_path):
    """At world size 1 no peer exists to blame: a step longer than --timeout is fine, a step
    longer than --step-timeout is this rank hanging, and the record says which limit fired."""
    run = ["run", "--strategy", "single", "--seq-len", "32", "--steps", "1", "--warmup", "0"]
    slow = {"TSPBENCH_FAULT": "slow:seconds=4:step=0"}
    ok = tspbench(*run, "--timeout", "1", "--out", tmp_path / "ok.json", env=slow)
    assert ok.returncode == 0 and json.loads((tmp_path / "ok.json").read_text())["status"] == "ok"
    out = tmp_path / "hung.json"
    hung = tspbench(*run, "--timeout", "1", "--step-timeout", "2", "--out", out, env=slow)
    rec = json.loads(out.read_text())
    assert hung.returncode == 1 and "this rank hung" in rec["error_message"], rec
    assert "--step-timeout 2" in rec["error_message"]


def test_a_peers_oom_is_the_record_when_rank_0_is_stopped_by_its_watchdog(tmp_path):
    """Rank 1 runs out of memory while rank 0 hangs in its step: rank 0's watchdog ends the run
    (--step-timeout) and the record names the root cause, rank 1's OOM, with status ``oom``:
    a sweep's expected OOM cells must not read as errors (they once did on this path)."""
    out = tmp_path / "oom.json"
    p = tspbench(
        "run", "--strategy", "tsp", "--degree", "2", "--seq-len", "64", "--launch", "local",
        "--timeout", "10", "--step-timeout", "8", "--out", out,
        env={"TSPBENCH_FAULT": "oom:rank=1,stall:rank=0"},
    )  # fmt: skip
    rec = json.loads(out.read_text())
    assert rec["status"] == "oom" and rec["failed_ranks"] == [1], (p.stderr[-2000:], rec)
    assert p.returncode == 0  # as an OOM exits on every other path
    assert "injected out of memory" in rec["error_message"]


def test_a_real_allocator_failure_is_recorded_as_oom(tmp_path):
    """The host allocator really fails: the run's address space is capped (RLIMIT_AS) at what
    Python and torch take once imported plus 500 MiB, and the model's first weight (a
    2**20 x 256 fp32 embedding, 1 GiB, allocated whole before it is sharded) cannot fit. The
    record says ``oom`` (exit 0), not ``error`` and not nothing: reporting it must not need the
    memory the failed step held. (One large request, so the cap bites in torch's allocator and
    not in one of Python's small ones, which fail without a usable message.)"""
    import resource

    probe = "import tspbench.cli, tspbench.runtime.run; print(open('/proc/self/status').read())"
    status = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout
    vm = next(int(x.split()[1]) * 1024 for x in status.splitlines() if x.startswith("VmPeak"))
    cap = vm + 500 * 2**20

    def capped() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    out = tmp_path / "oom.json"
    run = ["run", "--strategy", "single", "--seq-len", "32", "--mode", "infer", "--steps", "1",
           "--set", "vocab=1048576", "--set", "hidden=256", "--warmup", "0"]  # fmt: skip
    p = subprocess.run(
        [sys.executable, "-m", "tspbench", *run, "--out", str(out)],
        capture_output=True, text=True, preexec_fn=capped, timeout=300,
    )  # fmt: skip
    rec = json.loads(out.read_text())
    assert p.returncode == 0 and rec["status"] == "oom", (p.stderr[-2000:], rec)
    assert "can't allocate memory" in rec["error_message"], rec


def test_non_finite_results_are_an_error_in_strict_json(tmp_path):
    """A diverged run (NaN weights: the ``nan`` fault) is an error, and its record is strict
    JSON (``NaN`` is not JSON); ``check-record`` accepts it as such."""
    out = tmp_path / "nan.json"
    p = tspbench(*RUN, "--out", out, env={"TSPBENCH_FAULT": "nan"})
    rec = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the record"))
    assert p.returncode == 1 and rec["status"] == "error", rec
    assert "non-finite result: loss nan" in rec["error_message"] and rec["loss"] is None, rec
    assert tspbench("check-record", out).returncode == 0


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"MASTER_PORT": "in-use"}, "rendezvous at 127.0.0.1"),
        ({"MASTER_ADDR": "no-such-host.invalid"}, "rendezvous at no-such-host.invalid"),
        ({"WORLD_SIZE": "2", "MASTER_PORT": "free"}, "rendezvous at 127.0.0.1"),  # no rank 1
    ],
    ids=["port-in-use", "unresolvable-master", "a-peer-never-comes"],
)
def test_a_rendezvous_that_cannot_happen_is_named(tmp_path, env, needle):
    import socket

    from tspbench.runtime.launch import free_port

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        base = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        ports = {"in-use": port, "free": str(free_port())}
        env = {**base, **{k: ports.get(v, v) for k, v in env.items()}}
        out = tmp_path / "r.json"
        degree = ["--degree", env["WORLD_SIZE"]]
        p = tspbench(*RUN, *degree, "--timeout", "5", "--out", out, env=env, timeout=120)
    rec = json.loads(out.read_text())
    assert p.returncode == 1 and rec["status"] == "error", rec
    assert needle in rec["error_message"], rec["error_message"]


@pytest.mark.parametrize(
    "sig, when",
    [
        (signal.SIGTERM, "launcher"),  # the launcher is importing torch, no rank started
        (signal.SIGTERM, "import"),  # ranks still importing torch: no guard yet
        (signal.SIGINT, "import"),
        (signal.SIGTERM, "run"),  # a rank stalls mid-run, the rest wait in a collective
    ],
)
def test_a_signal_at_any_moment_leaves_a_record_saying_so(tmp_path, sig, when):
    """A SIGTERM/SIGINT to the launcher, from its first instant to the middle of the run, ends
    every rank and leaves a record that names the signal (the launcher exits 128 + signal)."""
    out = tmp_path / "t.json"
    cmd = [sys.executable, "-m", "tspbench", *FAULT_RUN, "--out", str(out), "--timeout", "60"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TSPBENCH_FAULT": "stall:rank=1:step=1"},
    )
    procs = {"launcher": 1, "import": 2, "run": 5}[when]  # the launcher, then its ranks
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(leftovers(str(out))) < procs:
        time.sleep(0.05)
    while when == "launcher" and time.monotonic() < deadline and not catches(proc.pid, sig):
        time.sleep(0.01)  # from tspbench's first line on (before it: the interpreter's start)
    if when == "run":
        time.sleep(4)
    proc.send_signal(sig)
    code = proc.wait(timeout=60)
    rec = json.loads(out.read_text())
    name = signal.Signals(sig).name
    assert rec["status"] == "error" and f"interrupted by {name}" in rec["error_message"], rec
    assert code == 128 + sig, (code, proc.stderr.read()[-2000:])
    assert leftovers(str(out)) == []


@pytest.mark.slow  # test_cli's launcher test already compares two runs' losses bit for bit
def test_same_seed_same_loss_bitwise(tmp_path):
    """Twice, the ranks forked from the launcher (a CPU-only torch's default) and spawned as
    fresh interpreters (a GPU build's): the same bits, the same peak."""
    recs = []
    for i, start in enumerate(("fork", "spawn")):
        out = tmp_path / f"d{i}.json"
        p = tspbench(
            "run",
            "--strategy",
            "tsp",
            "--degree",
            "2",
            "--seq-len",
            "64",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--launch",
            "local",
            "--quiet",
            "--out",
            str(out),
            env={"TSPBENCH_RANK_START": start},
        )
        assert p.returncode == 0, p.stderr[-2000:]
        recs.append(json.loads(out.read_text()))
    assert recs[0]["loss"] == recs[1]["loss"] and recs[0]["grad_norm"] == recs[1]["grad_norm"]
    assert recs[0]["peak_mem_bytes"] == recs[1]["peak_mem_bytes"]


def test_sweep_with_a_failing_and_an_oom_cell_finishes_and_marks_both(tmp_path):

    copy_workflow(tmp_path)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({**MINI, "name": "faulty"}))
    faults = "error:rank=1:seq_len=64:strategy=tsp,oom:rank=0:seq_len=64:strategy=tp"
    p = snakemake(
        "--cores", "2", "--configfile", "cfg.yaml", cwd=tmp_path, timeout=900,
        env={"TSPBENCH_FAULT": faults},
    )  # fmt: skip
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    df = pd.read_csv(tmp_path / "results/faulty/summary.csv").set_index("cell")
    assert df.loc["tsp.D2.g2.S64.B1.train", "status"] == "error"
    assert df.loc["tp.D2.g2.S64.B1.train", "status"] == "oom"
    assert (df["status"] == "ok").sum() == 2
    table = (tmp_path / "results/faulty/tables/md/memory_vs_seq.md").read_text()
    assert "OOM" in table and "failed" in table
    failures = (tmp_path / "results/faulty/tables/failures.md").read_text()
    assert "injected fault" in failures and "injected out of memory" in failures
    assert (tmp_path / "plots/faulty/png/memory_vs_seq.png").exists()


def _stalling_sweep(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """A one-cell sweep whose rank 1 stalls, started in its own process group; returns it and
    the cell's record path (relative to ``tmp_path``, as the ranks' command lines name it)."""
    copy_workflow(tmp_path)
    sweep = {**MINI["sweeps"][0], "strategies": ["tsp"], "seq_lens": [32]}
    cfg = {**MINI, "name": tmp_path.name, "timeout": 120, "sweeps": [sweep]}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen(
        [sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", "cfg.yaml"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "TSPBENCH_FAULT": "stall:rank=1:step=0"},
    )
    record = Path(f"results/{tmp_path.name}/runs/tsp.D2.g2.S32.B1.train.json")
    try:
        wait_for_rank(str(record), 1, timeout=120)
    except AssertionError:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    time.sleep(3)  # the ranks are in the run, rank 1 stalls
    return proc, record


def _gone(marker: str, within: float = 30) -> list[str]:
    deadline = time.monotonic() + within
    while leftovers(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    return leftovers(marker)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_a_sweep_leaves_no_final_record_and_the_plain_command_resumes(tmp_path, sig):
    """What CI cancellation, systemd and scancel do (SIGTERM), and Ctrl-C in a terminal (SIGINT
    to the foreground process group): the signal to the whole group in the middle of a cell.
    The cell's record must not look final (it goes beside the output, saying so), no rank is
    left, and the README's plain `snakemake --cores 2` redoes the cell."""
    proc, record = _stalling_sweep(tmp_path)
    os.killpg(proc.pid, sig)
    proc.wait(timeout=60)
    assert _gone(str(record)) == []
    assert not (tmp_path / record).exists(), (tmp_path / record).read_text()
    aside = json.loads((tmp_path / record).with_suffix(".interrupted.json").read_text())
    assert f"interrupted by {sig.name}" in aside["error_message"], aside
    if sig == signal.SIGINT:  # the resume does not depend on the signal: once is enough
        return
    again = snakemake("--cores", "2", "--configfile", "cfg.yaml", cwd=tmp_path, timeout=600)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert json.loads((tmp_path / record).read_text())["status"] == "ok"


def test_a_killed_pipeline_leaves_no_rank_behind(tmp_path):
    """SIGKILL to Snakemake alone (nothing can be handled): the launcher and its ranks die with
    their parents (parent-death signals) instead of running on as orphans."""
    proc, record = _stalling_sweep(tmp_path)
    proc.kill()
    proc.wait(timeout=30)
    assert _gone(str(record)) == []
    assert not (tmp_path / record).exists()
