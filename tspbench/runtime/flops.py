"""FLOP counting with torch's FlopCounterMode, taught the attention kernels it misses, causal
masks, and which work is recomputed.

torch 2.13 has no FLOP formula for ``_scaled_dot_product_flash_attention_for_cpu`` (it counts 0),
so the same formulas as the CUDA flash kernel are registered for it, forward and backward.
flash-attn's kernels never reach the dispatcher as an op torch knows: the attention entry point
reports their FLOPs to the active :class:`Counter` instead (without it, MFU at 7B/128K would
read about 3x low: attention is about 70% of the FLOPs there).

torch's SDPA formulas count every call as unmasked (Lq x Lk pairs): a causal call at D = 1 would
count twice its useful FLOPs, zigzag chunks at D = 8 1.06 times, so MFU would favour the
strategies that do not split the sequence. The counter scales each causal call's count to the
pairs its mask keeps (:func:`tspbench.core.attention.causal_pairs`), one rule for every
strategy and kernel, and counts apart what runs under :func:`tspbench.core.recompute.recomputing`
(activation recomputation, a loss's recomputed logits): :meth:`Counter.model_flops` is MFU's
count, ``get_total_flops`` what was executed.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import (
    FlopCounterMode,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from tspbench.core import attention, recompute

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


# attention ops whose formula ignores their causal mask: (mask alignment of ``is_causal``, the
# sequence dim of query and key). SDPA's is_causal is top-left; the CPU flash kernel is called
# causal only square (the entry point's diagonal block) or as the estimator's stand-in for
# flash-attn's lower-right call; flash's kernels are lower-right (torch's SDPA refuses them a
# non-square causal call, check_flash_causal_non_square_seqlens; the lower-right CausalBias the
# sdpa backend passes calls the aten flash op with is_causal=True, meaning lower-right).
# ``custom_mask_type`` (the efficient kernels) says its own: 1 top-left, 2 lower-right.
_CAUSAL = {
    "_scaled_dot_product_flash_attention_for_cpu": (True, -2),
    "_scaled_dot_product_flash_attention": (True, -2),
    "_scaled_dot_product_efficient_attention": (False, -2),
    "_scaled_dot_product_cudnn_attention": (False, -2),
    "_flash_attention": (True, 1),
    "_efficient_attention": (None, 1),
}


def causal_share(func_packet, flops: int, args: tuple, kwargs: dict) -> int:
    """``flops`` (an unmasked formula's count of one attention call) over the pairs its causal
    mask keeps; any other op's count unchanged."""
    name = func_packet.__name__.removesuffix("_backward").removesuffix("_forward")
    if name not in _CAUSAL or not flops:
        return flops
    schema = func_packet.default._schema.arguments
    bound = {a.name: v for a, v in zip(schema, args)} | kwargs
    lower_right, dim = _CAUSAL[name]
    varlen = bound.get("cu_seqlens_q", bound.get("cum_seq_q"))
    if not name.startswith("_scaled_dot_product") and varlen is not None:
        return flops  # packed variable-length batches: not called here
    if lower_right is None:
        mask = bound.get("custom_mask_type", 0)
        causal, lower_right = mask in (1, 2), mask == 2
    else:
        causal = bool(bound.get("is_causal", False))
    if not causal:
        return flops
    s_q, s_k = bound["query"].shape[dim], bound["key"].shape[dim]
    return flops * attention.causal_pairs(s_q, s_k, lower_right) // (s_q * s_k)


class _GlobalOnly:
    """FlopCounterMode's module tracker, for totals only: torch's hooks every ``nn.Module``'s
    forward and backward, which kept a checkpointed ``nn.Module`` model's activations alive
    (TP (torch) with recompute full: the estimate's steady step, which runs this counter, 74%
    above the measured one). The suite reads totals, never a per-module table."""

    parents = ("Global",)

    def __enter__(self) -> _GlobalOnly:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class Counter(FlopCounterMode):
    """FlopCounterMode that counts causal attention by its unmasked pairs, also counts the
    kernels it cannot see (flash-attn, as :mod:`tspbench.core.attention` reports them while
    this counter is active), and keeps recomputed work apart."""

    def __init__(self) -> None:
        super().__init__(display=False)
        self.mod_tracker = _GlobalOnly()  # type: ignore[assignment]
        self.recomputed = 0

    def model_flops(self) -> int:
        """FLOPs of forward and backward without recomputation (MFU's count)."""
        return int(self.get_total_flops()) - self.recomputed

    def _add(self, parents, key, flops: int) -> None:
        for par in parents:
            self.flop_counts[par][key] += flops
        if recompute.active():
            self.recomputed += flops

    def _heard(self, kernel: str, flops: int) -> None:
        self._add(["Global"], kernel, flops)

    def _count_flops(self, func_packet, out, args, kwargs):
        if func_packet in self.flop_registry:
            n = self.flop_registry[func_packet](*args, **kwargs, out_val=out)
            n = causal_share(func_packet, n, args, kwargs)
            self._add(set(self.mod_tracker.parents), func_packet, n)
        return out

    def __enter__(self):
        self.recomputed = 0
        attention.FLOP_LISTENERS.append(self._heard)
        return super().__enter__()

    def __exit__(self, *exc):
        attention.FLOP_LISTENERS.remove(self._heard)
        return super().__exit__(*exc)


def counter() -> Counter:
    """A :class:`Counter` (which also counts the CPU flash kernels and flash-attn's)."""
    _register()
    return Counter()


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
