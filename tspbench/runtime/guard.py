"""Keep a rank from hanging or vanishing without a word: signals and a progress watchdog.

SIGINT and SIGTERM (Ctrl-C, scancel, Slurm's time limit) get a no-op Python handler and a
wakeup pipe: whichever thread the kernel delivers them to, Python's C-level handler writes the
signal number into the pipe, and a guard thread blocked on that pipe acts at once, even while
the main thread sits inside a collective (a Python-level handler would wait for the collective
to return; blocking the signals per thread misses the threads torch started at import). A
second thread watches progress: if the main thread has not called :meth:`Guard.beat` for
``timeout`` seconds while it waits in a collective or the rendezvous (a peer hung or died), for
``step_timeout`` seconds outside any collective (this rank hung), or the run passes its
``time_limit`` (set below a scheduler's limit, so the run ends itself and says so instead of
being killed), the rank gives up.
Either way ``on_fatal(reason)`` runs once (it writes the record and tells the peers, and returns
the record's status), then the process exits at once: 0 if the status is ``oom``, as a run
that ran out of memory exits on every path.

A launcher that spawned this rank (``--launch local``) cannot see a rank that stopped
responding (SIGSTOP, a native hang that holds the GIL): it is alive but does nothing, and if it
is the only rank no peer times out. :func:`start_heartbeat`, also from the first line, touches
the file the launcher named in ``TSPBENCH_HEARTBEAT`` twice a second from a thread of its own;
such a rank stops touching it, and the launcher kills it once the file is older than the run's
``--timeout`` (:func:`tspbench.runtime.local.spawn_local`).

A signal can also come before the guard exists, while Python imports torch (seconds on a loaded
machine): :func:`hold_signals`, called on the first line of ``python -m tspbench``, remembers it,
and the guard acts on it as soon as it is up; a command that never starts a guard calls
:func:`release_signals`, which restores the default handlers and re-raises a held signal.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

SIGNALS = {signal.SIGINT, signal.SIGTERM}
_IMPORTED = time.monotonic()  # this module is imported on the first line of ``python -m tspbench``


def process_age_s() -> float:
    """Seconds since this process began: on Linux from the kernel's start time, so that the
    interpreter's own start-up counts (a run's ``startup_s``, what a scheduler's runtime must
    cover before the first step); elsewhere since the first line of ``python -m tspbench``."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22: starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic() - _IMPORTED


_held: list[int] = []


def hold_signals() -> None:
    """Until a guard (or :func:`release_signals`) takes over, remember SIGINT/SIGTERM instead of
    dying of them, so that a run interrupted during start-up still says so in its record."""
    for sig in SIGNALS:
        signal.signal(sig, lambda signum, _frame: _held.append(signum))


HEARTBEAT_ENV = "TSPBENCH_HEARTBEAT"
HEARTBEAT_S = 0.5


def start_heartbeat() -> None:
    """Touch ``$TSPBENCH_HEARTBEAT`` every :data:`HEARTBEAT_S` seconds while this process can
    run Python threads at all (nothing when the variable is unset: no launcher is watching)."""
    path = os.environ.get(HEARTBEAT_ENV)
    if not path:
        return

    def beat() -> None:
        while True:
            try:
                os.utime(path)  # the launcher made the file; only its time moves
            except FileNotFoundError:  # the launcher's directory went away with the launcher
                return
            except OSError:  # a passing failure (EINTR, a busy file system): beat again later
                pass
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=beat, daemon=True, name="tspbench-heartbeat").start()


def reset_held() -> None:
    """Forget held signals (a rank forked from a launcher starts with none of its own)."""
    _held.clear()


def held_signal() -> int | None:
    """The first signal that arrived while held, if any."""
    return _held[0] if _held else None


def release_signals() -> None:
    """Default handlers back; a signal that arrived while held now acts as it would have."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if _held:
        os.kill(os.getpid(), _held[0])


# What each limit's message starts with: the root cause is picked by reading them
# (tspbench.runtime.failure)
WAITED = "waited"  # in a collective, for a peer: a consequence
HUNG = "this rank hung"  # no progress outside any collective: a cause
RENDEZVOUS = "the rendezvous"


class Guard:
    """Signals and limits of one rank. ``timeout_s`` bounds a wait in a collective (and the
    rendezvous), ``step_timeout_s`` bounds work outside collectives (a long healthy step is
    not a hang), ``time_limit_s`` the whole run; each says which fired."""

    def __init__(
        self,
        timeout_s: float,
        on_fatal: Callable[[str], str | None],
        time_limit_s: float | None = None,
        step_timeout_s: float = 3600.0,
    ) -> None:
        self.timeout_s, self.step_timeout_s = timeout_s, step_timeout_s
        self.deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
        self.time_limit_s = time_limit_s
        self.on_fatal = on_fatal
        self.last = time.monotonic()
        self.rendezvous: str | None = None  # the master's address while joining the job
        self._once = threading.Lock()
        self._pipe_r, pipe_w = os.pipe()
        os.set_blocking(pipe_w, False)
        signal.set_wakeup_fd(pipe_w, warn_on_full_buffer=False)
        for sig in SIGNALS:
            signal.signal(sig, lambda *_: None)  # handled by the guard thread, via the pipe
        threading.Thread(target=self._signals, daemon=True, name="tspbench-signals").start()
        threading.Thread(target=self._watch, daemon=True, name="tspbench-watchdog").start()
        if _held:  # arrived during start-up: act on it now, as if it had come through the pipe
            os.write(pipe_w, bytes([_held[0]]))

    def beat(self) -> None:
        """The main thread made progress."""
        self.last = time.monotonic()

    def fatal(self, reason: str, code: int) -> None:
        if not self._once.acquire(blocking=False):
            return
        status = None
        try:
            status = self.on_fatal(reason)
        finally:  # a run that ran out of memory exits 0 on every path (its record says oom)
            os._exit(0 if code == 1 and status == "oom" else code)

    def _signals(self) -> None:
        while True:
            sig = os.read(self._pipe_r, 1)[0]
            if sig in SIGNALS:
                break
        name = signal.Signals(sig).name
        self.fatal(f"interrupted by {name} (Ctrl-C, scancel or a scheduler time limit)", 128 + sig)

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            now = time.monotonic()
            if self.deadline is not None and now > self.deadline:
                self.fatal(
                    f"time limit of {self.time_limit_s:g} s reached (--time-limit: the cell's "
                    "scheduler runtime minus a margin); the run did not finish in time",
                    1,
                )
            reason = self._stalled(now - self.last)
            if reason:
                self.fatal(reason, 1)

    def _stalled(self, idle: float) -> str | None:
        """Why this rank gives up after ``idle`` seconds without progress, if it does."""
        from tspbench.core.comm import in_collective  # not at import: signals are held first

        t = self.timeout_s
        if self.rendezvous is not None and idle > t:
            return (
                f"{RENDEZVOUS} at {self.rendezvous} did not complete in {idle:.0f} s (--timeout "
                f"{t:g}): a rank did not start, or the master address cannot be reached"
            )
        if in_collective() and idle > t:
            return f"{WAITED} {idle:.0f} s in a collective (--timeout {t:g}): a peer hung or died"
        if not in_collective() and idle > self.step_timeout_s:
            return (
                f"{HUNG}: no progress for {idle:.0f} s outside any collective "
                f"(--step-timeout {self.step_timeout_s:g})"
            )
        return None
