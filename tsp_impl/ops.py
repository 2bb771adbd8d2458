"""Small kernels shared by the TSP schedules."""

from __future__ import annotations

import torch


def accumulate(
    out: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, start: torch.Tensor | None = None
) -> torch.Tensor:
    """``out + a @ b``, written into ``out``; with ``out`` None a fresh ``start + a @ b`` (or
    ``a @ b``): one GEMM with beta = 1, no separate add (a residual ``start`` rides along in the
    GEMM's epilogue). Spelled ``torch.addmm(..., out=out)`` rather than ``addmm_``: the same
    kernel, but FlopCounterMode counts ``addmm`` and not its in-place form."""
    if out is None:
        return a @ b if start is None else torch.addmm(start, a, b)
    return torch.addmm(out, a, b, out=out)
