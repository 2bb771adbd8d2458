"""Fault injection for reliability tests and drills: ``TSPBENCH_FAULT=KIND[:key=value...][,...]``.

KIND: ``kill`` (the rank SIGKILLs itself), ``stall`` (sleeps forever), ``slow`` (a healthy but
long step: sleeps ``seconds``, default 3), ``nan`` (this rank's first weight becomes NaN: a
diverged run), ``error`` (raises), ``oom`` (raises an out-of-memory error), ``slower`` (every
step, from the first, lasts ``1 + fraction`` times as long: after the step the rank sleeps
``fraction`` (default 0.1) x its seconds, read on the host clock, so a CPU drill; the A/B
regression tests slow code down with it, a step's time being the slowest rank's). Keys select:
``rank`` (global rank, default 0), ``step`` (0-1 are the probe steps, 0-2 on CUDA, then
warmup and timed steps; default 0; ``slower`` ignores it), ``seq_len`` and ``strategy`` (only
runs of that sequence length / strategy). Several faults: comma-separated.
Unset, nothing happens.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tspbench.core.memory import TrackedOOM


def _faults(rank: int, seq_len: int, strategy: str) -> Iterator[tuple[str, dict[str, str], str]]:
    """(kind, keys, spec) of each fault set for this rank, sequence length and strategy."""
    for spec in filter(None, os.environ.get("TSPBENCH_FAULT", "").split(",")):
        kind, *pairs = spec.split(":")
        opts = dict(p.split("=", 1) for p in pairs)
        if int(opts.get("rank", 0)) != rank:
            continue
        if "seq_len" in opts and int(opts["seq_len"]) != seq_len:
            continue
        if opts.get("strategy", strategy) != strategy:
            continue
        yield kind, opts, spec


def inject(rank: int, step: int, seq_len: int, strategy: str, params=()) -> None:
    for kind, opts, spec in _faults(rank, seq_len, strategy):
        if kind == "slower" or int(opts.get("step", 0)) != step:
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


@contextmanager
def stretched(rank: int, seq_len: int, strategy: str) -> Iterator[None]:
    """The ``slower`` fault around one step: a proportional slowdown, as slower code would be."""
    fraction = sum(
        float(opts.get("fraction", 0.1))
        for kind, opts, _ in _faults(rank, seq_len, strategy)
        if kind == "slower"
    )
    t0 = time.perf_counter()
    yield
    if fraction:
        time.sleep(fraction * (time.perf_counter() - t0))
