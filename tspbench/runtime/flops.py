"""FLOP counting with torch's FlopCounterMode, taught the CPU flash-attention kernels.

torch 2.13 has no FLOP formula for ``_scaled_dot_product_flash_attention_for_cpu`` (it counts 0),
so the same formulas as the CUDA flash kernel are registered for it, forward and backward.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import (
    FlopCounterMode,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

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


def counter() -> FlopCounterMode:
    """A FlopCounterMode that also counts the CPU flash-attention kernels."""
    _register()
    return FlopCounterMode(display=False)


# Dense bf16 peak FLOP/s by device-name substring (datasheets, as in projection/hardware.json).
PEAK_FLOPS = {"MI300X": 1307e12, "H100": 989e12, "H200": 989e12}


def device_peak(device_name: str) -> float | None:
    for key, peak in PEAK_FLOPS.items():
        if key in device_name:
            return peak
    return None
