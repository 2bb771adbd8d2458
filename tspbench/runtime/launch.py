"""Where a rank learns who it is: torchrun, Slurm (srun), MPI (mpiexec), or a local spawn.

``detect()`` reads the environment a launcher left, in that order: torchrun's variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), else Slurm's (SLURM_PROCID,
SLURM_NTASKS, SLURM_LOCALID, first host of the step's node list), else MPI's through mpi4py
(rank 0 picks a free port and broadcasts its address). ``spawn_local`` starts N copies of the
same command with torchrun's variables set, so a local run takes exactly the torchrun path.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

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


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list: 'gpu[03-05,09],cpu1' -> 'gpu03'."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r}: cannot read a host name from it")
    if m.group(2):
        return m.group(1) + re.split(r"[-,]", m.group(2))[0]
    return m.group(1)


def _int_env(name: str) -> int:
    raw = os.environ[name]
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment {name}={raw!r}: must be an integer") from None


def detect() -> RankEnv | None:
    """The launcher environment of this process, or None when no launcher set one."""
    e = os.environ
    if "RANK" in e and "WORLD_SIZE" in e:
        if "MASTER_ADDR" not in e or "MASTER_PORT" not in e:
            raise ConfigError("RANK/WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not")
        lws = int(e["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in e else None
        return RankEnv(
            _int_env("RANK"),
            _int_env("WORLD_SIZE"),
            int(e.get("LOCAL_RANK", 0)),
            e["MASTER_ADDR"],
            _int_env("MASTER_PORT"),
            e.get("TSPBENCH_LAUNCHER", "torchrun"),  # "local": spawned by tspbench
            lws,
        )
    if "SLURM_PROCID" in e and "SLURM_NTASKS" in e:
        nodes = e.get("SLURM_STEP_NODELIST") or e.get("SLURM_JOB_NODELIST")
        if not nodes:
            raise ConfigError("SLURM_PROCID is set but SLURM_JOB_NODELIST is not")
        # one port per job step, stable across the step's tasks
        seed = int(e.get("SLURM_JOB_ID", "0")) * 31 + int(e.get("SLURM_STEP_ID", "0") or 0)
        port = int(e.get("MASTER_PORT") or 15000 + seed % 20000)
        per_node = e.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        return RankEnv(
            _int_env("SLURM_PROCID"),
            _int_env("SLURM_NTASKS"),
            int(e.get("SLURM_LOCALID", 0)),
            first_host(nodes),
            port,
            "slurm",
            int(per_node) if per_node.isdigit() else None,
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


def init(env: RankEnv, timeout_s: float) -> tuple[torch.device, str]:
    """Join the process group; return this rank's device and the backend."""
    if torch.cuda.is_available():
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


def spawn_local(argv: list[str], nproc: int, grace_s: float = 10.0) -> tuple[list[int], int | None]:
    """Run ``python -m tspbench <argv>`` as ``nproc`` local ranks (torchrun's variables set).

    When one rank fails, the others get ``grace_s`` to finish, then are killed: none is left
    behind. A SIGINT/SIGTERM to the launcher (held since start-up: :mod:`tspbench.runtime.guard`)
    is passed on to every rank. Returns the exit code of every rank started (negative: killed by
    that signal) and the signal the launcher received, if any (no rank is started after it).
    """
    from tspbench.runtime.guard import SIGNALS, held_signal

    got: list[int] = []
    procs: list[subprocess.Popen] = []

    def kill_all(sig: int = signal.SIGKILL) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    def forward(signum, _frame):  # Ctrl-C / scancel reach every rank
        got.append(signum)
        kill_all(signum)

    old = {s: signal.signal(s, forward) for s in SIGNALS}
    if held_signal() is not None:
        got.append(held_signal())
    port = free_port()
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
            )
            for k in ("SLURM_PROCID", "SLURM_NTASKS", *MPI_VARS):
                env.pop(k, None)
            procs.append(subprocess.Popen([sys.executable, "-m", "tspbench", *argv], env=env))
        if got:  # signalled while starting the ranks: pass it on to those already started
            kill_all(got[0])
        failed_at = None
        while [p for p in procs if p.poll() is None]:  # poll every rank, not up to a live one
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                kill_all()
            time.sleep(0.05)
    finally:
        kill_all()
        for p in procs:
            p.wait()
        for s, h in old.items():
            signal.signal(s, h)
    return [p.returncode for p in procs], (got[0] if got else None)
