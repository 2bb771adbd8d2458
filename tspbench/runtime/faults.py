"""Fault injection for reliability tests and drills: ``TSPBENCH_FAULT=KIND[:key=value...][,...]``.

KIND: ``kill`` (the rank SIGKILLs itself), ``stall`` (sleeps forever), ``slow`` (a healthy but
long step: sleeps ``seconds``, default 3), ``nan`` (this rank's first weight becomes NaN: a
diverged run), ``error`` (raises), ``oom`` (raises an out-of-memory error). Keys select where:
``rank`` (global rank, default 0), ``step`` (0-2 are the probe steps, then warmup and timed
steps; default 0), ``seq_len`` and ``strategy`` (only runs of that sequence length /
strategy). Several faults: comma-separated.
Unset, nothing happens.
"""

from __future__ import annotations

import os
import signal
import time

import torch

from tspbench.core.memory import TrackedOOM


def inject(rank: int, step: int, seq_len: int, strategy: str, params=()) -> None:
    for spec in filter(None, os.environ.get("TSPBENCH_FAULT", "").split(",")):
        kind, *pairs = spec.split(":")
        opts = dict(p.split("=", 1) for p in pairs)
        if int(opts.get("rank", 0)) != rank or int(opts.get("step", 0)) != step:
            continue
        if "seq_len" in opts and int(opts["seq_len"]) != seq_len:
            continue
        if opts.get("strategy", strategy) != strategy:
            continue
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "stall":
            time.sleep(10**7)
        elif kind == "nan":  # a diverged model: this rank's first weight becomes NaN
            with torch.no_grad():
                next(iter(params)).fill_(float("nan"))
        elif kind == "slow":
            time.sleep(float(opts.get("seconds", 3)))
        elif kind == "error":
            raise RuntimeError(f"injected fault ({spec})")
        elif kind == "oom":
            raise TrackedOOM(f"injected out of memory ({spec})")
        else:
            raise ValueError(f"TSPBENCH_FAULT={spec!r}: unknown kind {kind!r}")
