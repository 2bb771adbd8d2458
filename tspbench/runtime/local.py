"""``--launch local``: spawn the ranks on this machine and make sure a record exists afterwards.

Rank 0 writes the record; this launcher only amends it with what it alone saw (which rank died
of which signal) or, if rank 0 died before writing, writes it itself. A SIGINT/SIGTERM sent to
the launcher, at any moment from its first line on, is passed to every rank and named in the
record; the launcher then exits 128 + signal.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

from tspbench.core.config import ConfigError
from tspbench.runtime.launch import spawn_local
from tspbench.runtime.record import utc_now, write_json
from tspbench.runtime.spec import RunSpec


def run_local(command: str, spec: RunSpec, out: str, nproc: int, launch_argv: list[str]) -> int:
    """Run ``tspbench <command>`` for ``spec`` as ``nproc`` local ranks; return the exit code.

    ``launch_argv``: the options every rank gets besides the spec's (timeouts, output).
    """
    world = spec.layout.world_size
    if nproc != world:
        raise ConfigError(f"--nproc={nproc}: must equal degree x dp = {world}")
    argv = [command, *spec.to_argv(), *launch_argv, "--out", out, "--launch", "env"]
    path = Path(out)
    before = path.stat().st_mtime_ns if path.exists() else None
    codes, got = spawn_local(argv, nproc)
    fresh = path.exists() and path.stat().st_mtime_ns != before
    killed = {r: -c for r, c in enumerate(codes) if c < 0}
    died = "; ".join(f"rank {r} killed by {signal.Signals(s).name}" for r, s in killed.items())
    header = {**spec.header("local", world), "rank_exit_codes": codes}
    if got is not None:  # the launcher itself was signalled, perhaps before any rank's guard
        interrupted = f"interrupted by {signal.Signals(got).name} (sent to the launcher)"
        rec = json.loads(path.read_text()) if fresh else {}
        if "interrupted by" not in str(rec.get("error_message")):
            message = f"{interrupted}; {died}" if died else interrupted
            rec = {**header, "status": "error", "error_message": message}
        write_json(path, {**rec, "rank_exit_codes": codes, "timestamp_utc": utc_now()})
        return 128 + got
    if not fresh:  # rank 0 died before writing: the launcher leaves the record instead
        message = died or f"rank 0 wrote no record (exit codes {codes})"
        write_json(
            path,
            {**header, "status": "error", "error_message": message, "timestamp_utc": utc_now()},
        )
        return 1
    if killed:  # the launcher alone saw which rank died: add it to the record
        rec = json.loads(path.read_text())
        rec["rank_exit_codes"] = codes
        if rec.get("status") == "error":
            rec["error_message"] = f"{died}; rank 0 saw: {rec.get('error_message')}"
        write_json(path, rec)
    return 0 if codes[0] == 0 else 1
