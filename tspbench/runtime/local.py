"""``--launch local``: spawn the ranks on this machine and make sure a record exists afterwards.

Rank 0 writes the record; this launcher only amends it with what it alone saw (which rank died
of which signal, which rank it had to kill itself) or, if rank 0 died before writing, writes it
itself. A SIGINT/SIGTERM sent to the launcher, at any moment from its first line on, is passed
to every rank and named in the record; the launcher then exits 128 + signal. The launcher dies
with its parent, and its ranks with it (parent-death signals): a killed pipeline leaves no rank.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from tspbench.core.config import ConfigError
from tspbench.runtime.launch import LocalRanks, die_with_parent, spawn_local
from tspbench.runtime.record import interrupted_path, utc_now, write_json
from tspbench.runtime.spec import RunSpec

GRACE_S = 10.0  # how long the other ranks get after one fails


def max_local_ranks() -> int:
    """Ranks one machine may spawn: 4 per core, at least 8 (beyond, a typo such as --dp 65536
    would fork the machine to death)."""
    return max(8, 4 * (os.cpu_count() or 1))


def check_local_world(world: int, nproc: int) -> None:
    """--nproc must match the spec, and this machine must be able to hold that many ranks."""
    if nproc != world:
        raise ConfigError(f"--nproc={nproc}: must equal degree x dp = {world}")
    if world > max_local_ranks():
        raise ConfigError(
            f"degree x dp = {world}: --launch local starts at most {max_local_ranks()} ranks on "
            f"this machine ({os.cpu_count()} cores); use a cluster launcher (srun, torchrun)"
        )


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
        write_json(aside, {**rec, "rank_exit_codes": codes, "timestamp_utc": utc_now()})
        return 128 + seen.signal
    aside = Path(interrupted_path(out))
    if cell and aside.exists() and aside.stat().st_mtime_ns > started:  # rank 0 was signalled
        return codes[0] if codes[0] >= 128 else 1
    if not fresh:  # rank 0 died before writing: the launcher leaves the record instead
        message = died or f"rank 0 wrote no record (exit codes {codes})"
        failed = list(seen.silent) or seen.killed_by_launcher
        failed = failed or [r for r, c in enumerate(codes) if c != 0]
        record = {**header, "status": "error", "error_message": message, "failed_ranks": failed}
        write_json(path, {**record, "timestamp_utc": utc_now()})
        return 0 if cell else 1
    rec = json.loads(path.read_text())
    if died:  # the launcher alone saw which rank died: add it to the record
        rec["rank_exit_codes"] = codes
        if seen.silent:  # the cause, which rank 0 only saw as a dead peer
            rec["failed_ranks"] = list(seen.silent)
        if rec.get("status") == "error":
            rec["error_message"] = f"{died}; rank 0 saw: {rec.get('error_message')}"
        write_json(path, rec)
    return 0 if cell or codes[0] == 0 else 1
