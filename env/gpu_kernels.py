"""Attention kernels and the host/device balance on one GPU: what the cost model assumes, measured.

    python3 env/gpu_kernels.py OUT.json [--part kernels|probe|all]

``kernels``: forward and forward+backward seconds and TFLOP/s of the attention entry point's
kernels on this device (``torch_flash``: PyTorch's FlashAttention-2 op; ``sdpa``: PyTorch's
SDPA, which picks its own kernel for square causal calls and a lower-right CausalBias for
zigzag chunks), at the 7B's head size (32 heads of 128), square causal (4K, 16K) and a zigzag
chunk (2K queries over 16K keys), and PyTorch's SDPA backends one by one on the square call.
FLOPs count the causal (query, key) pairs, as the suite counts them.
``probe``: the doctor's rank probe (rank 0 of a D = 8 cell on the fake process group: compute
and dispatch, no communication) at longer sequences, with the host's issue time beside the
step time: where TSP's many small operations stop setting the pace.
Measurements only: nothing here is fitted or committed as a rate (docs/projection.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tspbench.core import attention
from tspbench.runtime.record import versions
from tspbench.runtime.timing import timed


def _median_s(fn, device: torch.device, reps: int = 5) -> float:
    fn()  # warm-up (kernel selection, workspace)
    return statistics.median(timed(fn, device)[1] for _ in range(reps))


def kernels(device: torch.device, dtype: torch.dtype) -> list[dict]:
    """One row per (kernel, shape): forward, forward+backward seconds and TFLOP/s."""
    big = device.type == "cuda"
    heads, d = (32, 128) if big else (4, 32)
    shapes = [(4096, 4096), (16384, 16384), (2048, 16384)] if big else [(256, 256), (64, 256)]
    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    for lq, lk in shapes:
        q, dout = (torch.randn(1, heads, lq, d, device=device, dtype=dtype, generator=g)
                   for _ in range(2))  # fmt: skip
        k, v = (torch.randn(1, heads, lk, d, device=device, dtype=dtype, generator=g)
                for _ in range(2))  # fmt: skip
        flops = 4 * heads * d * attention.causal_pairs(lq, lk)
        for kernel in ["torch_flash", "sdpa"] if big else ["cpu_flash", "sdpa"]:
            fwd, fb = _entry_point(kernel, (q, k, v, dout), device)
            rows.append(_row(kernel, lq, lk, fwd, fb, flops))
        if lq == lk and big:  # PyTorch's own SDPA backends, one at a time, square causal
            for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
                try:
                    fwd, fb = _sdpa_backend(name, (q, k, v, dout), device)
                    rows.append(_row(f"sdpa:{name}", lq, lk, fwd, fb, flops))
                except RuntimeError as e:
                    rows.append({"kernel": f"sdpa:{name}", "lq": lq, "lk": lk, "error": str(e)})
    return rows


def _entry_point(kernel: str, inputs: tuple, device: torch.device) -> tuple[float, float]:
    """(forward, forward+backward) seconds of the suite's attention entry point on ``kernel``."""
    q, k, v, dout = inputs

    def both() -> None:
        out, lse = attention.causal_fwd(q, k, v)
        attention.causal_bwd(dout, q, k, v, out, lse)

    with attention.forced(kernel):
        return _median_s(lambda: attention.causal_fwd(q, k, v), device), _median_s(both, device)


def _sdpa_backend(name: str, inputs: tuple, device: torch.device) -> tuple[float, float]:
    """(forward, forward+backward) seconds of PyTorch's SDPA held to one backend (``name``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, dout = inputs
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))

    def call() -> torch.Tensor:
        return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)

    with sdpa_kernel(getattr(SDPBackend, name)):
        return (
            _median_s(lambda: call().detach(), device),
            _median_s(lambda: call().backward(dout), device),
        )


def _row(kernel: str, lq: int, lk: int, fwd: float, fb: float, flops: float) -> dict:
    return {
        "kernel": kernel, "lq": lq, "lk": lk, "fwd_s": fwd, "fwd_bwd_s": fb,
        "fwd_tflops": flops / fwd / 1e12, "fwd_bwd_tflops": 3.5 * flops / fb / 1e12,
    }  # fmt: skip


def probes(device: torch.device) -> list[dict]:
    """The rank probe's step and host-issue times at longer sequences (7B, 2 layers, D = 8)."""
    from tspbench.pipeline.rank_probe import rank_probe

    big = device.type == "cuda"
    plan = (
        [(65536, ["tsp", "tp"]), (131072, ["tsp", "tp", "sp", "fsdp_cp"])]
        if big
        else [(2048, ["tsp", "tp"])]
    )
    out = []
    for seq, names in plan:
        cell = ("7b", 2, seq, "bf16") if big else ("small", 2, seq, "fp32")
        _, res = rank_probe(device, 8, cell, names, echo=True)
        out += res
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--part", choices=("kernels", "probe", "all"), default="all")
    args = ap.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    result: dict = {"versions": versions(None), "device": str(device)}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(0)
    t0 = time.monotonic()
    if args.part in ("probe", "all"):
        result["probe"] = probes(device)
        args.out.write_text(json.dumps(result, indent=1, default=str))
    if args.part in ("kernels", "all"):
        result["kernels"] = kernels(device, dtype)
        for r in result["kernels"]:
            print(json.dumps(r), flush=True)
    result["seconds"] = time.monotonic() - t0
    args.out.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
