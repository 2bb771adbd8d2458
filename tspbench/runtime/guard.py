"""Keep a rank from hanging or vanishing without a word: signals and a progress watchdog.

SIGINT and SIGTERM (Ctrl-C, scancel, Slurm's time limit) get a no-op Python handler and a
wakeup pipe: whichever thread the kernel delivers them to, Python's C-level handler writes the
signal number into the pipe, and a guard thread blocked on that pipe acts at once, even while
the main thread sits inside a collective (a Python-level handler would wait for the collective
to return; blocking the signals per thread misses the threads torch started at import). A
second thread watches progress: if the main thread has not called :meth:`Guard.beat` for
``timeout`` seconds (a set-up phase, a step or a collective that never ends), or the run passes
its ``time_limit`` (set below a scheduler's limit, so the run ends itself and says so instead of
being killed), the rank gives up.
Either way ``on_fatal(reason)`` runs once (it writes the record and tells the peers), then the
process exits at once.

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

SIGNALS = {signal.SIGINT, signal.SIGTERM}
_held: list[int] = []


def hold_signals() -> None:
    """Until a guard (or :func:`release_signals`) takes over, remember SIGINT/SIGTERM instead of
    dying of them, so that a run interrupted during start-up still says so in its record."""
    for sig in SIGNALS:
        signal.signal(sig, lambda signum, _frame: _held.append(signum))


def held_signal() -> int | None:
    """The first signal that arrived while held, if any."""
    return _held[0] if _held else None


def release_signals() -> None:
    """Default handlers back; a signal that arrived while held now acts as it would have."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if _held:
        os.kill(os.getpid(), _held[0])


class Guard:
    def __init__(
        self, timeout_s: float, on_fatal: Callable[[str], None], time_limit_s: float | None = None
    ) -> None:
        self.timeout_s = timeout_s
        self.deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
        self.time_limit_s = time_limit_s
        self.on_fatal = on_fatal
        self.last = time.monotonic()
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
        try:
            self.on_fatal(reason)
        finally:
            os._exit(code)

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
            idle = now - self.last
            if idle > self.timeout_s:
                self.fatal(
                    f"no progress for {idle:.0f} s (--timeout {self.timeout_s:g}): a rank hung "
                    "or a peer died",
                    1,
                )
