"""Where a rank learns who it is: torchrun, Slurm (srun), MPI (mpiexec), or a local spawn.

``detect()`` reads the environment a launcher left, in that order: torchrun's variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), else Slurm's (SLURM_PROCID,
SLURM_NTASKS, SLURM_LOCALID, first host of the step's node list), else MPI's through mpi4py
(rank 0 picks a free port and broadcasts its address). ``--launch local``
(:mod:`tspbench.runtime.local`) starts N copies of the same command with torchrun's variables
set, so a local run takes exactly the torchrun path.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from dataclasses import dataclass
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


def gpu_index(local_rank: int, visible: int | None = None) -> int:
    """This rank's GPU: its local rank among the visible GPUs. With one GPU visible every local
    rank takes it: right where a launcher binds one GPU per task (Slurm's --gpus-per-task), two
    ranks on one GPU otherwise, which NCCL refuses when it starts ("Duplicate GPU"). A local
    rank beyond several visible GPUs is refused here."""
    visible = torch.cuda.device_count() if visible is None else visible
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise ConfigError(
            f"local rank {local_rank}: only {visible} GPUs visible on this node; start at most "
            f"{visible} ranks per node, or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
        )
    return local_rank


def init(env: RankEnv, timeout_s: float, device: str = "auto") -> tuple[torch.device, str]:
    """Join the process group; return this rank's device and the backend (``device``: auto
    takes a GPU when one is visible)."""
    check_device(device)
    if device != "cpu" and torch.cuda.is_available():
        dev, backend = torch.device("cuda", gpu_index(env.local_rank)), "nccl"
        torch.cuda.set_device(dev)
    else:
        dev, backend = torch.device("cpu"), "gloo"
        local = env.local_world_size or 1
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    dist.init_process_group(
        backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=dev if backend == "nccl" else None,  # NCCL: its communicator up front
    )
    return dev, backend


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
