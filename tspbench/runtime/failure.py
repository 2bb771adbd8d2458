"""How a failed rank tells its peers why, and how rank 0 names the root cause.

The failing rank posts its cause to the job's key-value store (:func:`post`) and leaves
(:func:`leave`): its connections close, so the peers' collectives fail at once instead of after
``--timeout``. Rank 0 reads every posted cause (:func:`causes`) and picks the one that started it
(:func:`root_cause`): an OOM anywhere, else the first real error, else a silent rank. The store
lives in rank 0's process, which leaves once it has written the record: every read here is
best effort and never raises.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import NoReturn

import torch
import torch.distributed as dist

from tspbench.runtime.guard import HUNG, RENDEZVOUS, WAITED

FAIL_KEY = "tspbench/fail/{}"
TRACEBACK_KEY = "tspbench/traceback/{}"  # a failed rank's traceback, which rank 0 prints once
WRITTEN_KEY = "tspbench/record-written"


OOM_TEXTS = ("out of memory", "can't allocate memory", "cannot allocate memory")


def classify(e: BaseException) -> str:
    """``oom`` for the device's or the host allocator's out-of-memory errors, else ``error``."""
    text = str(e).lower()
    oom = isinstance(e, torch.OutOfMemoryError | MemoryError) or any(t in text for t in OOM_TEXTS)
    return "oom" if oom else "error"


def post(status: str, msg: str, wait_s: float = 2.0, tb: str = "") -> None:
    """Tell the peers why this rank stopped, and its traceback (best effort: the store may be
    gone with rank 0)."""

    def send() -> None:
        try:
            store = dist.distributed_c10d._get_default_store()
            if tb:  # before the cause: rank 0 reads it once it has read the cause
                store.set(TRACEBACK_KEY.format(dist.get_rank()), tb)
            store.set(FAIL_KEY.format(dist.get_rank()), f"{status}\t{msg}")
        except Exception:
            pass

    t = threading.Thread(target=send, daemon=True)
    try:
        t.start()
    except RuntimeError:  # no thread to spare: the peers see the connection close instead
        return
    t.join(wait_s)


def await_record(store=None, wait_s: float = 15.0) -> None:
    """A failing rank other than 0 stays until rank 0 has written the record, or is gone: under
    ``srun --kill-on-bad-exit`` (or torchrun) its exit would kill rank 0 before it could say
    why. ``store``: the job's store, taken before the process group was closed. Bounded by
    ``wait_s`` even when a store call blocks (rank 0, the store's host, stopped)."""

    def wait() -> None:
        deadline = time.monotonic() + wait_s
        try:
            s = store or dist.distributed_c10d._get_default_store()
            while time.monotonic() < deadline and not s.check([WRITTEN_KEY]):
                time.sleep(0.1)
        except Exception:  # the store went with rank 0: nothing left to wait for
            pass

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    t.join(wait_s)


def exit_now(code: int) -> NoReturn:
    """Rank 0 after writing a failed run's record: end the process at once. Its process group
    cannot be closed in order (the peers are gone or going), and the interpreter's exit would
    destroy c10d threads that are still joinable: std::terminate, SIGABRT (seen as rank 0
    exiting -6 after writing an OOM record, and a launcher exit 1 for a run whose result was
    the OOM it was asked to show)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def leave(world: int, status: str) -> bool:
    """A failed rank other than 0: close its connections (the peers' collectives fail at once
    instead of after --timeout), then wait for rank 0's record. True if an OOM is known."""
    store = dist.distributed_c10d._get_default_store()
    oom = status == "oom" or any(s == "oom" for s, _ in causes(world, 1.0, store=store).values())
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    await_record(store)
    return oom


def causes(
    world: int, wait_s: float = 3.0, quiet_s: float = 0.75, store=None
) -> dict[int, tuple[str, str]]:
    """Failure causes posted by any rank: waits until every rank posted, an OOM is in, no new
    cause came for ``quiet_s`` after the first, or ``wait_s`` passed. A store that fails (its
    host, rank 0, has written the record and left; a connection reset while peers close
    theirs) ends the wait with what was read: the failure path never raises."""
    found: dict[int, tuple[str, str]] = {}
    now = time.monotonic()
    deadline, last = now + wait_s, None
    try:
        store = store or dist.distributed_c10d._get_default_store()
    except Exception:
        return found
    while True:
        for r in range(world):
            key = FAIL_KEY.format(r)
            try:
                if r in found or not store.check([key]):
                    continue
                status, msg = store.get(key).decode().split("\t", 1)
            except Exception:  # DistNetworkError, DistStoreError: the store is gone
                return found
            found[r], last = (status, msg), time.monotonic()
        now = time.monotonic()
        quiet = last is not None and now - last > quiet_s
        if len(found) == world or any(s == "oom" for s, _ in found.values()):
            return found
        if quiet or now > deadline:
            return found
        time.sleep(0.1)


def traceback_of(rank: int, me: int, own: str = "") -> str:
    """The traceback rank ``rank`` posted (``own``: this rank's, ``me``, when it is the one);
    empty when it posted none or the store is gone."""
    if rank == me:
        return own
    try:
        store = dist.distributed_c10d._get_default_store()
        key = TRACEBACK_KEY.format(rank)
        return store.get(key).decode() if store.check([key]) else ""
    except Exception:
        return ""


def root_cause(
    causes: dict[int, tuple[str, str]], own: tuple[str, str], world: int
) -> tuple[str, str, list[int]]:
    """The failure that started it, and the ranks it names: an OOM anywhere, else the first real
    error, else a rank that hung (its own watchdog, or the ranks that posted nothing while every
    other rank waited for a peer), else this rank's own (a closed connection, a wait).

    Returns (status, message, failed ranks)."""
    ordered = sorted(causes.items())

    def tier(cause: tuple[str, str]) -> int:
        msg = cause[1].lower()
        if cause[0] == "oom":
            return 0
        if any(s in msg for s in (WAITED, RENDEZVOUS, "connection closed", "connection reset")):
            return 3  # a consequence of another rank's failure
        return 2 if HUNG in msg or "time limit" in msg else 1

    best = min([c for _, c in ordered] + [own], key=tier)
    if tier(best) == 3:
        silent = [r for r in range(world) if r not in causes]
        if silent:
            who = ", ".join(map(str, silent))
            return (
                "error",
                f"rank {who} hung: no error and no progress from it while the others "
                f"{best[1][best[1].find(WAITED) :] if WAITED in best[1] else best[1]}",
                silent,
            )
    return best[0], best[1], [r for r, c in ordered if c == best] or sorted(causes)
