"""FLOP counting with torch's FlopCounterMode, taught the attention kernels it misses.

torch 2.13 has no FLOP formula for ``_scaled_dot_product_flash_attention_for_cpu`` (it counts 0),
so the same formulas as the CUDA flash kernel are registered for it, forward and backward.
flash-attn's kernels never reach the dispatcher as an op torch knows: the attention entry point
reports their FLOPs to the active :class:`Counter` instead (without it, MFU at 7B/128K would
read about 3x low: attention is about 70% of the FLOPs there).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import (
    FlopCounterMode,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from tspbench.core import attention

_aten = torch.ops.aten
_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    _registered = True

    @register_flop_formula(_aten._scaled_dot_product_flash_attention_for_cpu, get_raw=True)
    def _fwd(query, key, value, *args, out_val=None, **kwargs):
        b, h, s_q, d = query.shape
        s_k = key.shape[-2]
        return sdpa_flop_count((b, h, s_q, d), (b, h, s_k, d), (b, h, s_k, value.shape[-1]))

    @register_flop_formula(_aten._scaled_dot_product_flash_attention_for_cpu_backward, get_raw=True)
    def _bwd(grad_out, query, key, value, *args, out_val=None, **kwargs):
        b, h, s_q, d = query.shape
        s_k, dv = key.shape[-2], value.shape[-1]
        return sdpa_backward_flop_count(
            (b, h, s_q, dv), (b, h, s_q, d), (b, h, s_k, d), (b, h, s_k, dv)
        )


class Counter(FlopCounterMode):
    """FlopCounterMode that also counts the attention kernels it cannot see (flash-attn), as
    :mod:`tspbench.core.attention` reports them while this counter is active."""

    def _heard(self, kernel: str, flops: int) -> None:
        self.flop_counts["Global"][kernel] += flops

    def __enter__(self):
        attention.FLOP_LISTENERS.append(self._heard)
        return super().__enter__()

    def __exit__(self, *exc):
        attention.FLOP_LISTENERS.remove(self._heard)
        return super().__exit__(*exc)


def counter() -> FlopCounterMode:
    """A FlopCounterMode that also counts the CPU flash kernels and flash-attn's."""
    _register()
    return Counter(display=False)


# Dense bf16 peak FLOP/s by device-name substring (datasheets, as in projection/hardware.json),
# the more specific names first: "NVIDIA H100 PCIe" and "H100 NVL" are not the SXM part.
PEAK_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12,
              "A100": 312e12, "MI300X": 1307e12}  # fmt: skip


def device_peak(device_name: str) -> float | None:
    """The device's dense bf16 peak (None: not listed, so no MFU rather than a wrong one)."""
    for key, peak in PEAK_FLOPS.items():
        if key in device_name:
            return peak
    return None
