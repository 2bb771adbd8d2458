"""Counter-based parameter init: any block of a weight, on any device, without the whole weight.

Each element's value is a pure function of (seed, parameter name, its flat index in the full
[out, in] tensor), so a rank generates only the shard it keeps, directly on its device, and every
layout (and the reference) sees bit-identical values. The hash is murmur3's fmix32 done in int64
with every product below 2^48 (the 32-bit constants split into 16-bit halves, then masked), so it
is exact on CPU and CUDA alike; the normal-ish value is Irwin-Hall (the sum of four 16-bit
uniforms, an exact integer) scaled once, so CPU and GPU round it the same.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch._subclasses.fake_tensor import FakeTensor

_M32 = 0xFFFFFFFF
# elements generated at once: on a CPU the int64 temporaries stay cache-sized (4x faster than 2^22
# on the 7B); a GPU takes big chunks, so kernel launches stay few
_CHUNK = {"cpu": 1 << 15}
_CHUNK_GPU = 1 << 22
# Irwin-Hall of four uniforms on {0..65535}: mean 2 * 65535, variance 4 * (65536^2 - 1) / 12
_MEAN = 2 * 65535
_STD = math.sqrt(4 * (65536**2 - 1) / 12)

Index = slice | torch.Tensor | None


def param_keys(seed: int, name: str) -> tuple[int, int]:
    """Two 32-bit keys from (seed, name): a stable hash, not dict order, names the parameter."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for 0 <= x < 2^32 without overflow: each partial product is < 2^48."""
    hi = (x * (c >> 16)).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return x.mul(c & 0xFFFF).add_(hi).bitwise_and_(_M32)


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x.bitwise_xor_(x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x.bitwise_xor_(x >> 16)


def values(flat: torch.Tensor, keys: tuple[int, int], std: float) -> torch.Tensor:
    """fp32 values of the elements at flat indices ``flat`` (int64, < 2^32) of one parameter."""
    a = _fmix32(_mul32(flat, 0x9E3779B1).bitwise_xor_(keys[0]))
    b = _fmix32(a ^ keys[1])
    s = (a & 0xFFFF).add_(a >> 16).add_(b & 0xFFFF).add_(b >> 16).sub_(_MEAN)
    return s.to(torch.float64).mul_(std / _STD).to(torch.float32)


def _indices(ix: Index, n: int, device: torch.device) -> torch.Tensor:
    if ix is None:
        ix = slice(None)
    if isinstance(ix, slice):
        return torch.arange(*ix.indices(n), device=device, dtype=torch.int64)
    return ix.to(device=device, dtype=torch.int64)


def block(
    shape: tuple[int, ...],
    keys: tuple[int, int],
    std: float,
    rows: Index = None,
    cols: Index = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``full[rows][:, cols]`` of the [out, in] weight ``shape`` (rows/cols: slices or index
    tensors), generated a few rows at a time so no temporary outgrows a chunk."""
    R, C = shape
    if R * C >= 1 << 32:
        raise ValueError(f"shape {shape}: flat indices must stay below 2^32")
    device = torch.device(device)
    r, c = _indices(rows, R, device), _indices(cols, C, device)
    out = torch.empty(len(r), len(c), dtype=torch.float32, device=device)
    if isinstance(out, FakeTensor):
        return out  # fake tensors hold no values: hashing them would only cost time
    step = max(1, _CHUNK.get(device.type, _CHUNK_GPU) // max(1, len(c)))
    for i in range(0, len(r), step):
        flat = r[i : i + step, None] * C + c[None, :]
        out[i : i + step] = values(flat, keys, std)
    return out


def flat_range(
    numel: int,
    keys: tuple[int, int],
    std: float,
    start: int,
    stop: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Elements [start, stop) of a weight's flattened full tensor (FSDP's flat shards)."""
    if numel >= 1 << 32:
        raise ValueError(f"numel {numel}: flat indices must stay below 2^32")
    start, stop = max(0, start), min(numel, stop)
    device = torch.device(device)
    out = torch.empty(max(0, stop - start), dtype=torch.float32, device=device)
    if isinstance(out, FakeTensor):
        return out  # (no values to compute, as in block)
    step = _CHUNK.get(device.type, _CHUNK_GPU)
    for i in range(start, stop, step):
        flat = torch.arange(i, min(stop, i + step), device=device, dtype=torch.int64)
        out[i - start : i - start + len(flat)] = values(flat, keys, std)
    return out


def chunk_slice(n: int, parts: int, i: int) -> slice:
    """The indices ``torch.arange(n).chunk(parts)[i]`` covers, without building anything."""
    size = -(-n // parts)
    return slice(min(n, i * size), min(n, (i + 1) * size))
