"""One line of ``tspbench doctor``: a :class:`Check` and how a check function becomes one
(shared by the doctor and its rank probe, which the lead's GPU script also calls alone)."""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

# measured/estimated peak memory a node may show and still be ready: the allocator's rounding,
# cuBLAS workspaces and flash-attn's own buffers are not in the estimate; a first bound
PEAK_BOUND = (0.75, 1.33)


@dataclass
class Check:
    name: str
    status: str  # ok | FAILED | skipped
    detail: str
    seconds: float = 0.0

    def line(self) -> str:
        tail = f": {self.detail}" if self.detail else ""
        return f"{self.status:8s} {self.name}{tail} ({self.seconds:.1f} s)"


def run_check(name: str, fn: Callable[[], str | None], skip: str | None = None) -> Check:
    """Run one check: ``fn`` returns a detail line or raises AssertionError (FAILED)."""
    if skip:
        return Check(name, "skipped", skip)
    t0 = time.monotonic()
    try:
        detail, status = fn() or "", "ok"
    except AssertionError as e:
        detail, status = str(e), "FAILED"
    except Exception as e:  # a crash is a failed check, not a crashed doctor
        detail, status = f"{type(e).__name__}: {e}", "FAILED"
        traceback.print_exc(file=sys.stderr)
    return Check(name, status, detail, time.monotonic() - t0)


def in_bound(ratio: float) -> bool:
    """Whether a measured/estimated peak ratio is within :data:`PEAK_BOUND`."""
    return PEAK_BOUND[0] <= ratio <= PEAK_BOUND[1]
