"""Where a rank learns who it is: torchrun, Slurm (srun), MPI (mpiexec), or a local spawn.

``detect()`` reads the environment a launcher left, in that order: torchrun's variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), else Slurm's (SLURM_PROCID,
SLURM_NTASKS, SLURM_LOCALID, first host of the step's node list), else MPI's through mpi4py
(rank 0 picks a free port and broadcasts its address). ``spawn_local`` starts N copies of the
same command with torchrun's variables set, so a local run takes exactly the torchrun path.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tspbench.core.config import ConfigError

MPI_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # torchrun | slurm | mpi | single
    local_world_size: int | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def expand_nodelist(nodelist: str) -> list[str]:
    """Host names of a Slurm node list, in order, as ``scontrol show hostnames`` prints them:
    'gpu[03-05,09],cpu1' -> gpu03 gpu04 gpu05 gpu09 cpu1; 'r[1-2]n[01-02]' -> r1n01 r1n02 r2n01
    r2n02 (every bracket expands; a range keeps its zero padding)."""
    hosts: list[str] = []
    items = re.findall(r"(?:[^,\[\]]+|\[[^\]\[]*\])+", nodelist.strip())
    if ",".join(items) != nodelist.strip():
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r}: not a Slurm node list")
    for item in items:
        parts = re.split(r"(\[[^\]]*\])", item)
        names = [""]
        for part in filter(None, parts):
            if not part.startswith("["):
                names = [n + part for n in names]
                continue
            choices = []
            for rng in part[1:-1].split(","):
                lo, _, hi = rng.partition("-")
                if not lo.isdigit() or (hi and not hi.isdigit()):
                    raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r}: cannot read {part!r}")
                width = len(lo)
                choices += [str(i).zfill(width) for i in range(int(lo), int(hi or lo) + 1)]
            names = [n + c for n in names for c in choices]
        hosts += names
    if not hosts or not all(hosts):
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r}: cannot read a host name from it")
    return hosts


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list (checked by :func:`expand_nodelist`): as
    ``scontrol show hostnames`` prints it where Slurm is installed, else as parsed here."""
    parsed = expand_nodelist(nodelist)
    try:
        shown = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10
        )
        if shown.returncode == 0 and shown.stdout.split():
            return shown.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return parsed[0]


def _int_env(name: str, lo: int = 0, hi: int = 2**31 - 1, default: int | None = None) -> int:
    """An integer environment variable in [lo, hi] (ConfigError naming it otherwise)."""
    raw = os.environ.get(name)
    if raw is None or (raw == "" and default is not None):
        if default is None:
            raise ConfigError(f"environment {name}: not set")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"environment {name}={raw!r}: must be an integer") from None
    if not lo <= value <= hi:
        raise ConfigError(f"environment {name}={raw!r}: must be between {lo} and {hi}")
    return value


def _checked(env: RankEnv) -> RankEnv:
    """Every launcher variable consistent before anything waits on a peer."""
    if env.world_size < 1 or not 0 <= env.rank < env.world_size:
        raise ConfigError(
            f"rank {env.rank} of world size {env.world_size} (from {env.source}): the rank must "
            "be between 0 and world size - 1"
        )
    lws = env.local_world_size
    if lws is not None and not (1 <= lws <= env.world_size and 0 <= env.local_rank < lws):
        raise ConfigError(
            f"local rank {env.local_rank} of {lws} local ranks (from {env.source}): must be "
            f"below the local world size, which must be between 1 and {env.world_size}"
        )
    if not env.master_addr.strip():
        raise ConfigError(f"master address {env.master_addr!r} (from {env.source}): empty")
    return env


def _launcher_env() -> str:
    """Who set RANK/WORLD_SIZE: torchrun, unless ``--launch local`` spawned this rank and says
    so (``TSPBENCH_LAUNCHER=local``); anything else would write a record the schema refuses."""
    name = os.environ.get("TSPBENCH_LAUNCHER", "torchrun")
    if name not in ("torchrun", "local"):
        raise ConfigError(f"TSPBENCH_LAUNCHER={name!r}: must be 'local' (set by --launch local)")
    return name


def detect() -> RankEnv | None:
    """The launcher environment of this process (checked), or None when no launcher set one."""
    e = os.environ
    if "RANK" in e and "WORLD_SIZE" in e:
        if "MASTER_ADDR" not in e or "MASTER_PORT" not in e:
            raise ConfigError("RANK/WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not")
        lws = _int_env("LOCAL_WORLD_SIZE", 1, 65536) if "LOCAL_WORLD_SIZE" in e else None
        return _checked(
            RankEnv(
                _int_env("RANK", 0, 65535),
                _int_env("WORLD_SIZE", 1, 65536),
                _int_env("LOCAL_RANK", 0, 65535, default=0),
                e["MASTER_ADDR"],
                _int_env("MASTER_PORT", 1, 65535),
                _launcher_env(),
                lws,
            )
        )
    if "SLURM_PROCID" in e and "SLURM_NTASKS" in e:
        nodes = e.get("SLURM_STEP_NODELIST") or e.get("SLURM_JOB_NODELIST")
        if not nodes:
            raise ConfigError("SLURM_PROCID is set but SLURM_JOB_NODELIST is not")
        # one port per job step, stable across the step's tasks
        job, step = _int_env("SLURM_JOB_ID", default=0), _int_env("SLURM_STEP_ID", default=0)
        port = _int_env("MASTER_PORT", 1, 65535, default=15000 + (job * 31 + step) % 20000)
        per_node = e.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        return _checked(
            RankEnv(
                _int_env("SLURM_PROCID", 0, 65535),
                _int_env("SLURM_NTASKS", 1, 65536),
                _int_env("SLURM_LOCALID", 0, 65535, default=0),
                first_host(nodes),
                port,
                "slurm",
                int(per_node) if per_node.isdigit() else None,
            )
        )
    if any(v in e for v in MPI_VARS):
        try:
            from mpi4py import MPI
        except ImportError:
            raise ConfigError(
                "an MPI launcher is present but mpi4py is missing: pip install 'tspbench[mpi]'"
            ) from None
        comm = MPI.COMM_WORLD
        addr = (socket.gethostname(), free_port()) if comm.rank == 0 else None
        host, port = comm.bcast(addr, root=0)
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        return RankEnv(comm.rank, comm.size, local.rank, host, port, "mpi", local.size)
    return None


DEVICES = ("auto", "cpu", "cuda")


def check_device(choice: str) -> None:
    """``cuda`` (CUDA or ROCm) must exist here: a GPU run must never fall back to the CPU."""
    if choice == "cuda" and not torch.cuda.is_available():
        build = torch.version.cuda and f"CUDA {torch.version.cuda}" or torch.version.hip
        what = f"a {build} build of torch" if build else "a CPU-only build of torch"
        raise ConfigError(
            f"--device=cuda: no GPU is visible ({what}, torch {torch.__version__}); install the "
            "CUDA or ROCm build that matches this node, or run with --device cpu"
        )


def init(env: RankEnv, timeout_s: float, device: str = "auto") -> tuple[torch.device, str]:
    """Join the process group; return this rank's device and the backend (``device``: auto
    takes a GPU when one is visible)."""
    check_device(device)
    if device != "cpu" and torch.cuda.is_available():
        device, backend = torch.device("cuda", env.local_rank % torch.cuda.device_count()), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
        local = env.local_world_size or 1
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    dist.init_process_group(
        backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return device, backend


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> Callable[[], None]:
    """A function that asks Linux to send ``sig`` to the calling process when its parent exits
    (prctl PR_SET_PDEATHSIG), so that a killed launcher or pipeline leaves no orphan; it exits
    at once if the parent is already gone. ``parent``: the pid that parent has (default: this
    process, for a child's ``preexec_fn``, which must not import: made here, called there).
    Elsewhere than Linux: a no-op."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return lambda: None
    parent = os.getpid() if parent is None else parent

    def arm() -> None:
        prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(128 + int(sig))

    return arm


@dataclass
class LocalRanks:
    """What ``spawn_local`` saw: each rank's exit code (negative: killed by that signal), the
    ranks it killed itself (they had not ended ``grace_s`` after a peer failed, or had stopped
    responding: ``silent``), and the signal the launcher received, if any."""

    codes: list[int]
    killed_by_launcher: list[int]
    signal: int | None
    silent: dict[int, float] = field(default_factory=dict)  # rank -> seconds without a beat


def spawn_local(
    argv: list[str],
    nproc: int,
    grace_s: float = 10.0,
    after_rank0_s: float = 2.0,
    deadline_s: float | None = None,
    silent_s: float = 300.0,
) -> LocalRanks:
    """Run ``python -m tspbench <argv>`` as ``nproc`` local ranks (torchrun's variables set).

    Every rank is polled. When one fails, the others get ``grace_s`` to finish (only
    ``after_rank0_s`` once rank 0, the record's writer, has ended), then are killed: none is
    left behind. ``deadline_s``: the launcher's own limit for the whole job. A rank whose
    heartbeat file (:func:`tspbench.runtime.guard.start_heartbeat`) is older than ``silent_s``
    (at least :data:`MIN_SILENT_S`) has stopped responding: it is killed, and its peers then
    fail or finish as after any death. A SIGINT/SIGTERM to
    the launcher (held since start-up: :mod:`tspbench.runtime.guard`) is passed on to every
    rank, and no rank is started after it. Ranks die with the launcher (parent-death signal).
    """
    from tspbench.runtime.guard import HEARTBEAT_ENV, SIGNALS, held_signal

    got: list[int] = []
    silent: dict[int, float] = {}
    beats = Path(tempfile.mkdtemp(prefix="tspbench-heartbeat-"))
    silent_s = max(silent_s, MIN_SILENT_S)
    procs: list[subprocess.Popen] = []
    mine: set[int] = set()

    def kill_all(sig: int = signal.SIGKILL, by_launcher: bool = False) -> None:
        for r, p in enumerate(procs):
            if p.poll() is None:
                p.send_signal(sig)
                if by_launcher:
                    mine.add(r)

    def forward(signum, _frame):  # Ctrl-C / scancel reach every rank
        got.append(signum)
        kill_all(signum)

    old = {s: signal.signal(s, forward) for s in SIGNALS}
    if held_signal() is not None:
        got.append(held_signal())
    port, start, arm = free_port(), time.monotonic(), die_with_parent()
    try:
        for r in range(nproc):
            if got:
                break
            env = dict(
                os.environ,
                RANK=str(r),
                WORLD_SIZE=str(nproc),
                LOCAL_RANK=str(r),
                LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                TSPBENCH_LAUNCHER="local",
                **{HEARTBEAT_ENV: str(beats / str(r))},
            )
            for k in ("SLURM_PROCID", "SLURM_NTASKS", *MPI_VARS):
                env.pop(k, None)
            cmd = [sys.executable, "-m", "tspbench", *argv]
            procs.append(subprocess.Popen(cmd, env=env, preexec_fn=arm))
        if got:  # signalled while starting the ranks: pass it on to those already started
            kill_all(got[0])
        failed_at = None
        while [p for p in procs if p.poll() is None]:  # poll every rank, every time
            for r, quiet in _silent_ranks(procs, beats, start, silent_s).items():
                if r not in silent:
                    procs[r].kill()
                    silent[r] = quiet
                    mine.add(r)
            now = time.monotonic()
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            grace = after_rank0_s if procs[0].returncode is not None else grace_s
            late = deadline_s is not None and now - start > deadline_s
            if late or (failed_at is not None and now - failed_at > grace):
                kill_all(by_launcher=True)
            time.sleep(0.05)
    finally:
        kill_all()
        for p in procs:
            p.wait()
        for s, h in old.items():
            signal.signal(s, h)
        shutil.rmtree(beats, ignore_errors=True)
    codes = [p.returncode for p in procs]
    killed = sorted(r for r in mine if codes[r] < 0)
    return LocalRanks(codes, killed, got[0] if got else None, silent)


MIN_SILENT_S = 10.0  # a rank may hold the GIL this long while loading torch's libraries


def _silent_ranks(
    procs: list[subprocess.Popen], beats: Path, start: float, silent_s: float
) -> dict[int, float]:
    """Running ranks whose heartbeat file (or, before the first beat, whose start) is more than
    ``silent_s`` seconds old: rank -> seconds."""
    now, out = time.time(), {}
    started = now - (time.monotonic() - start)
    for r, p in enumerate(procs):
        if p.poll() is not None:
            continue
        try:
            last = (beats / str(r)).stat().st_mtime
        except FileNotFoundError:
            last = started
        if now - last > silent_s:
            out[r] = now - last
    return out


def available_memory() -> int | None:
    """Bytes of memory this machine can still give (Linux MemAvailable), None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_memory(spec, ranks_here: int, model_peak: float = 0.0) -> None:
    """Refuse a run that cannot fit this machine's memory, before anything is allocated: each
    rank here builds the global token batch (tokens and labels, int64), initialises one full
    fp32 weight at a time before slicing its shard (the embedding is the largest), and, when it
    computes on this host (CPU), holds its model's peak (``model_peak``: the caller's closed
    form, bytes per rank, capped by ``--max-memory``, which turns more into an ``oom`` record)."""
    cfg, lay = spec.cfg, spec.layout
    tokens = 2 * 8 * spec.batch * lay.dp * spec.seq_len
    weight = 4 * max(cfg.vocab * cfg.hidden, 3 * cfg.ffn * cfg.hidden)
    if spec.max_memory is not None:
        model_peak = min(model_peak, spec.max_memory)
    need, have = ranks_here * (tokens + weight + model_peak), available_memory()
    if have is not None and need > have:
        what = "the token batch, one full weight" + (" and the model's peak" if model_peak else "")
        raise ConfigError(
            f"batch={spec.batch} x dp={lay.dp} x seq_len={spec.seq_len}: the {ranks_here} "
            f"rank(s) here need {need / 2**30:.1f} GiB for {what} (closed form); this machine "
            f"has {have / 2**30:.1f} GiB available"
        )
