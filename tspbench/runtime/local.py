"""``--launch local``: spawn the ranks on this machine and make sure a record exists afterwards.

``spawn_local`` starts the ranks with torchrun's variables, polls every one of them and kills
those that outlive a failed peer or stop responding (a heartbeat file each). Rank 0 writes the
record; this launcher only amends it with what it alone saw (which rank died
of which signal, which rank it had to kill itself) or, if rank 0 died before writing, writes it
itself. A SIGINT/SIGTERM sent to the launcher, at any moment from its first line on, is passed
to every rank and named in the record; the launcher then exits 128 + signal. The launcher dies
with its parent, and its ranks with it (parent-death signals): a killed pipeline leaves no rank.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tspbench.core.config import ConfigError
from tspbench.runtime.launch import MPI_VARS, free_port
from tspbench.runtime.record import interrupted_path, record_written, utc_now
from tspbench.runtime.spec import RunSpec

GRACE_S = 10.0  # how long the other ranks get after one fails
WHO = "the local launcher"  # who could not write a record, when a file system refuses it


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


def name_process(name: str) -> None:
    """This process's name as ``ps -o comm`` and ``top`` show it (Linux; 15 bytes kept)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME = 15


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
    from tspbench.runtime.guard import SIGNALS, held_signal

    ranks = _Ranks()
    silent: dict[int, float] = {}
    beats = Path(tempfile.mkdtemp(prefix="tspbench-heartbeat-"))
    silent_s = max(silent_s, MIN_SILENT_S)
    old = {s: signal.signal(s, ranks.forward) for s in SIGNALS}
    if (held := held_signal()) is not None:
        ranks.got.append(held)
    port, start, arm = free_port(), time.monotonic(), die_with_parent()
    try:
        _start_ranks(ranks, argv, nproc, port, beats, arm)
        if ranks.got:  # signalled while starting the ranks: pass it on to those already started
            ranks.kill_all(ranks.got[0])
        _watch(ranks, beats, silent, silent_s, grace_s, after_rank0_s, start, deadline_s)
    finally:
        ranks.kill_all()
        codes = [p.wait() for p in ranks.procs]
        for s, h in old.items():
            signal.signal(s, h)
        shutil.rmtree(beats, ignore_errors=True)
    killed = sorted(r for r in ranks.mine if codes[r] < 0)
    return LocalRanks(codes, killed, ranks.got[0] if ranks.got else None, silent)


@dataclass
class _Ranks:
    """The ranks ``spawn_local`` started, those it signalled itself (``mine``) and the signals
    the launcher received (``got``)."""

    procs: list[subprocess.Popen | _Forked] = field(default_factory=list)
    mine: set[int] = field(default_factory=set)
    got: list[int] = field(default_factory=list)

    def kill_all(self, sig: int = signal.SIGKILL, by_launcher: bool = False) -> None:
        for r, p in enumerate(self.procs):
            if p.poll() is None:
                p.send_signal(sig)
                if by_launcher:
                    self.mine.add(r)

    def forward(self, signum, _frame) -> None:  # Ctrl-C / scancel reach every rank
        self.got.append(signum)
        self.kill_all(signum)


def _rank_env(r: int, nproc: int, port: int, beat: Path) -> dict[str, str]:
    """Rank ``r``'s environment: torchrun's variables, its heartbeat file, no Slurm or MPI
    rank variables."""
    from tspbench.runtime.guard import HEARTBEAT_ENV

    env = dict(
        os.environ,
        RANK=str(r),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(r),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TSPBENCH_LAUNCHER="local",
        **{HEARTBEAT_ENV: str(beat)},
    )
    for k in ("SLURM_PROCID", "SLURM_NTASKS", *MPI_VARS):
        env.pop(k, None)
    return env


START_ENV = "TSPBENCH_RANK_START"  # fork | spawn: how ranks start (default: see rank_start)


def rank_start() -> str:
    """``fork`` where the launcher can hand its imported torch to the ranks: a CPU-only torch
    build, which cannot have touched a GPU before the fork (a forked rank skips the 2-3 s of CPU
    each rank spends importing torch and torch._dynamo: with 4 ranks on 2 cores, most of a tiny
    cell's start-up); else ``spawn``, a fresh interpreter per rank, as torchrun starts them.
    ``$TSPBENCH_RANK_START`` chooses (a bad value is refused)."""
    import torch

    choice = os.environ.get(START_ENV, "")
    if choice not in ("", "fork", "spawn"):
        raise ConfigError(f"{START_ENV}={choice!r}: must be fork or spawn")
    if choice:
        return choice
    gpu_build = torch.version.cuda is not None or torch.version.hip is not None
    return "spawn" if gpu_build or not hasattr(os, "fork") else "fork"


class _Forked:
    """A rank forked from this launcher, with what ``spawn_local`` uses of ``subprocess.Popen``
    (``returncode`` negative when a signal killed it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def _reaped(self, flags: int) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, flags)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._reaped(os.WNOHANG)

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _fork_rank(argv: list[str], env: dict[str, str], arm: Callable[[], None]) -> _Forked:
    """Fork one rank that runs ``tspbench <argv>`` in ``env``: ``python -m tspbench``'s own
    module, run again in the child (signals held and its heartbeat started first, then the
    command, as in a spawned rank); it never returns here."""
    import runpy

    from tspbench.runtime import guard

    sys.stdout.flush()
    sys.stderr.flush()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, guard.SIGNALS)  # the launcher's handlers
    pid = os.fork()  # must not run in the child: it holds them until its own are set
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return _Forked(pid)
    code = 1
    try:
        guard.reset_held()
        guard.hold_signals()
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        arm()
        name_process(f"tspbench-r{env['RANK']}")  # its command line is the launcher's
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["tspbench", *argv]
        sys.modules.pop("tspbench.__main__", None)  # (the launcher's, when it is the script)
        runpy.run_module("tspbench", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _start_ranks(
    ranks: _Ranks, argv: list[str], nproc: int, port: int, beats: Path, arm: Callable[[], None]
) -> None:
    """Start the ranks one by one (:func:`rank_start`); none after a signal reached the
    launcher."""
    how = rank_start()
    if how == "fork":
        import torch._dynamo  # noqa: F401  (every rank imports it: once, here)
    for r in range(nproc):
        if ranks.got:
            break
        env = _rank_env(r, nproc, port, beats / str(r))
        (beats / str(r)).touch()  # its start counts as its first beat
        if how == "fork":
            ranks.procs.append(_fork_rank(argv, env, arm))
        else:
            cmd = [sys.executable, "-m", "tspbench", *argv]
            ranks.procs.append(subprocess.Popen(cmd, env=env, preexec_fn=arm))


def _watch(
    ranks: _Ranks,
    beats: Path,
    silent: dict[int, float],
    silent_s: float,
    grace_s: float,
    after_rank0_s: float,
    start: float,
    deadline_s: float | None,
) -> None:
    """Poll every rank until none runs: kill the silent ones (recorded in ``silent``), and all
    of them once the grace after a failure, or ``deadline_s`` after ``start`` (the monotonic
    clock), has passed."""
    procs = ranks.procs
    heard: dict[int, tuple[int, float]] = {}  # rank -> (heartbeat mtime, when first seen)
    failed_at = None
    while [p for p in procs if p.poll() is None]:  # poll every rank, every time
        for r, quiet in _silent_ranks(procs, beats, heard, silent_s).items():
            if r not in silent:
                procs[r].kill()
                silent[r] = quiet
                ranks.mine.add(r)
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        grace = after_rank0_s if procs[0].returncode is not None else grace_s
        late = deadline_s is not None and now - start > deadline_s
        if late or (failed_at is not None and now - failed_at > grace):
            ranks.kill_all(by_launcher=True)
        time.sleep(0.05)


MIN_SILENT_S = 10.0  # a rank may hold the GIL this long while loading torch's libraries


def _silent_ranks(
    procs: list[subprocess.Popen | _Forked],
    beats: Path,
    seen: dict[int, tuple[int, float]],
    silent_s: float,
) -> dict[int, float]:
    """Running ranks whose heartbeat file has not changed for more than ``silent_s`` seconds:
    rank -> seconds. ``seen`` keeps, per rank, the file's last modification time and when (on
    this launcher's monotonic clock) it was first seen, so a wall-clock jump changes nothing."""
    now, out = time.monotonic(), {}
    for r, p in enumerate(procs):
        if p.poll() is not None:
            continue
        try:
            mtime = (beats / str(r)).stat().st_mtime_ns
        except OSError:
            continue  # (the launcher made it; a failed stat is not silence)
        if seen.get(r, (None, 0.0))[0] != mtime:
            seen[r] = (mtime, now)
        elif now - seen[r][1] > silent_s:
            out[r] = now - seen[r][1]
    return out


def max_local_ranks() -> int:
    """Ranks one machine may spawn: 4 per core, at least 8 (beyond, a typo such as --dp 65536
    would fork the machine to death)."""
    return max(8, 4 * (os.cpu_count() or 1))


def check_local_world(world: int, nproc: int) -> None:
    """--nproc must match the spec, and this machine must be able to hold that many ranks."""
    if nproc != world:
        raise ConfigError(f"--nproc={nproc}: must equal degree x dp x pp = {world}")
    if world > max_local_ranks():
        raise ConfigError(
            f"degree x dp x pp = {world}: --launch local starts at most {max_local_ranks()} "
            f"ranks on this machine ({os.cpu_count()} cores); use a cluster launcher (srun, "
            "torchrun)"
        )


def _root_ranks(seen: LocalRanks) -> list[int]:
    """The ranks that started it, as the launcher saw it: those that stopped responding, else
    those that died of a signal it did not send, else those that exited non-zero on their own;
    the ranks it killed for outliving a failed peer only as a last resort."""
    mine = set(seen.killed_by_launcher)
    own = [r for r, c in enumerate(seen.codes) if c != 0 and r not in mine]
    return list(seen.silent) or [r for r in own if seen.codes[r] < 0] or own or sorted(mine)


def _seen_dead(seen: LocalRanks) -> list[int]:
    """Ranks the launcher saw die on their own: silent ones, else those killed by a signal it
    did not send. Its direct evidence, which beats rank 0's inference (a peer that had not yet
    posted why when rank 0 looked is not the one that died)."""
    mine = set(seen.killed_by_launcher)
    foreign = [r for r, c in enumerate(seen.codes) if c < 0 and r not in mine]
    return list(seen.silent) or foreign


def amend(rec: dict, seen: LocalRanks) -> dict:
    """Rank 0's record with what the launcher alone saw: each rank's exit code, the ranks that
    died (see :func:`_seen_dead`) and, for an error, which rank died of what."""
    died = _what_happened(seen)
    if not died:
        return rec
    rec = {**rec, "rank_exit_codes": seen.codes}
    dead = _seen_dead(seen)
    if dead:
        rec["failed_ranks"] = dead
    if rec.get("status") == "error":
        rec["error_message"] = f"{died}; rank 0 saw: {rec.get('error_message')}"
    return rec


def _what_happened(seen: LocalRanks) -> str:
    """The launcher's own account: which rank died of which signal, which it killed itself."""
    out = []
    for r, c in enumerate(seen.codes):
        if r in seen.silent:
            out.append(
                f"rank {r} stopped responding (no heartbeat for {seen.silent[r]:.0f} s: stopped, "
                "or hung holding the interpreter): killed by the launcher"
            )
        elif r in seen.killed_by_launcher:
            out.append(f"rank {r} still running after its peers had ended: killed by the launcher")
        elif c < 0:
            out.append(f"rank {r} killed by {signal.Signals(-c).name}")
    return "; ".join(out)


def run_local(
    command: str,
    spec: RunSpec,
    out: str,
    nproc: int,
    launch_argv: list[str],
    deadline_s: float | None = None,
    cell: bool = False,
    silent_s: float = 300.0,
) -> int:
    """Run ``tspbench <command>`` for ``spec`` as ``nproc`` local ranks; return the exit code.

    ``launch_argv``: the options every rank gets besides the spec's (timeouts, output).
    ``silent_s``: a rank that shows no sign of life for this long is killed (the run's
    ``--timeout``: no rank may stop responding for longer than a collective may wait).
    ``cell``: a pipeline cell: any final record (ok, oom, error) exits 0, and an interrupted
    run's record goes beside ``out`` (:func:`interrupted_path`), never to it.
    """
    world = spec.layout.world_size
    check_local_world(world, nproc)
    rank_start()  # a bad choice is refused before any rank starts
    die_with_parent(signal.SIGTERM, os.getppid())()
    argv = [command, *spec.to_argv(), *launch_argv, "--out", out, "--launch", "env"]
    path = Path(out)
    before = path.stat().st_mtime_ns if path.exists() else None
    started = time.time_ns()
    seen = spawn_local(argv, nproc, GRACE_S, deadline_s=deadline_s, silent_s=silent_s)
    codes = seen.codes
    fresh = path.exists() and path.stat().st_mtime_ns != before
    died = _what_happened(seen)
    header = {**spec.header("local", world), "rank_exit_codes": codes}
    if seen.signal is not None:  # the launcher itself was signalled, perhaps before any guard
        aside = Path(interrupted_path(out)) if cell else path
        interrupted = f"interrupted by {signal.Signals(seen.signal).name} (sent to the launcher)"
        rec = json.loads(aside.read_text()) if aside.exists() and (cell or fresh) else {}
        if "interrupted by" not in str(rec.get("error_message")):
            message = f"{interrupted}; {died}" if died else interrupted
            rec = {**header, "status": "error", "error_message": message}
        record_written(aside, {**rec, "rank_exit_codes": codes, "timestamp_utc": utc_now()}, WHO)
        return 128 + seen.signal
    aside = Path(interrupted_path(out))
    if cell and aside.exists() and aside.stat().st_mtime_ns > started:  # rank 0 was signalled
        return codes[0] if codes[0] >= 128 else 1
    if not fresh:  # rank 0 died before writing: the launcher leaves the record instead
        message = died or f"rank 0 wrote no record (exit codes {codes})"
        failed = _root_ranks(seen)
        record = {**header, "status": "error", "error_message": message, "failed_ranks": failed}
        written = record_written(path, {**record, "timestamp_utc": utc_now()}, WHO)
        return 0 if cell and written else 1
    rec = json.loads(path.read_text())
    if died and not record_written(path, amend(rec, seen), WHO):
        return 1
    return 0 if cell or codes[0] == 0 else 1
