"""Timing, in one place: every measured time of the suite (training steps, decode's prefill and
steps, the overlap benchmark, the calibration's microbenchmarks, the GEMM rate) starts and ends
synchronized with the device, so that all strategies are timed alike. On a GPU a timed region
is bounded by CUDA events on the current stream; on a CPU by the wall clock."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """(``fn()``, its seconds), the device synchronized before and after."""
    out, seconds, _ = timed_issue(fn, device)
    return out, seconds


def timed_issue(fn: Callable[[], T], device: torch.device) -> tuple[T, float, float]:
    """(``fn()``, its seconds, the host's seconds to issue it): the device synchronized before
    and after, the issue time read when ``fn`` returns, before the device is waited for. On a
    GPU an issue time close to the step time says the host, not the device, sets the pace (the
    queue never fills); on a CPU the two are the same clock."""
    sync(device)
    t0 = time.perf_counter()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        issue = time.perf_counter() - t0
        end.record()
        sync(device)
        return out, start.elapsed_time(end) / 1e3, issue
    out = fn()
    seconds = time.perf_counter() - t0
    return out, seconds, seconds


def slowest(times: list[float], device: torch.device) -> list[float]:
    """Each entry's largest value over the ranks (collective): a step lasts as long as its
    slowest rank. On the device, as NCCL wants its tensors."""
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()
