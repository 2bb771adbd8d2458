"""Ring attention's blocks (tspbench/core/ring_attention.py): the ``sdpa`` backend's written-out
block (a GPU without flash-attn) equals the CPU flash kernel's, forward and backward given the
merged out/lse, causal and unmasked, MHA and GQA; and two blocks merged by their log-sum-exp
equal one call over both key ranges."""

from __future__ import annotations

import pytest
import torch

from tspbench.core import attention
from tspbench.core.attention import block_bwd, block_fwd
from tspbench.core.ring_attention import _merge


def _qkv(hq: int, hkv: int, lq: int, lk: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, lq, 16, generator=g)
    k, v = (torch.randn(2, hkv, lk, 16, generator=g) for _ in range(2))
    return q, k, v, torch.randn(2, hq, lq, 16, generator=g)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hkv", [4, 2])
def test_math_block_equals_cpu_kernel(causal: bool, hkv: int):
    q, k, v, dout = _qkv(4, hkv, 12, 12 if causal else 20)
    want = block_fwd(q, k, v, causal)
    want_g = block_bwd(dout, q, k, v, *want, causal)
    with attention.forced("sdpa"):
        got = block_fwd(q, k, v, causal)
        got_g = block_bwd(dout, q, k, v, *want, causal)
    for a, b in zip((*got, *got_g), (*want, *want_g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_merged_blocks_equal_one_call():
    q, k, v, _ = _qkv(4, 2, 8, 24)
    out, lse = block_fwd(q, k, v, causal=False)
    o1, l1 = block_fwd(q, k[:, :, :10], v[:, :, :10], causal=False)
    acc, acc_lse = o1.float(), l1.clone()
    _merge(acc, acc_lse, *block_fwd(q, k[:, :, 10:], v[:, :, 10:], causal=False))
    torch.testing.assert_close(acc, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(acc_lse, lse, rtol=1e-5, atol=1e-6)
