"""The GPU path as far as a CPU can check it: which attention kernel a dtype gets, and the
flash-attn calls (layouts, the saved log-sum-exp, the backward adapter for two releases'
signatures) through a stand-in package written in plain math."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.helpers.fake_flash_attn import install
from tspbench.core import attention


@pytest.mark.parametrize(
    "device, dtype, has_flash, want",
    [
        ("cuda", torch.bfloat16, True, "flash_attn"),
        ("cuda", torch.float16, True, "flash_attn"),
        ("cuda", torch.float32, True, "sdpa"),  # flash-attn has no fp32 kernel
        ("cuda", torch.bfloat16, False, "sdpa"),
        ("cpu", torch.float32, True, "cpu_flash"),
    ],
)
def test_flash_attn_only_for_half_precision(monkeypatch, device, dtype, has_flash, want):
    monkeypatch.setattr(attention, "HAS_FLASH_ATTN", has_flash)
    assert attention.backend_for(torch.device(device), dtype) == want


@pytest.fixture(params=["2.5", "2.7"])
def fake_flash(request, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(install(tmp_path, request.param)))
    for name in ("flash_attn", "flash_attn.flash_attn_interface"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield request.param
    for name in ("flash_attn", "flash_attn.flash_attn_interface"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("lq, lk, hq, hkv", [(16, 16, 4, 4), (8, 24, 4, 2)])
def test_flash_forward_and_own_backward_equal_sdpa(fake_flash, lq, lk, hq, hkv):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, hq, lq, 8, generator=g)
    k, v = (torch.randn(2, hkv, lk, 8, generator=g) for _ in range(2))
    dout = torch.randn(2, hq, lq, 8, generator=g)
    with attention.forced("flash_attn"):
        out, lse = attention.causal_fwd(q, k, v)
        grads = attention.causal_bwd(dout, q, k, v, out, lse)
    with attention.forced("sdpa"):
        ref, _ = attention.causal_fwd(q, k, v)
        ref_grads = attention.causal_bwd(dout, q, k, v, ref, None)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert lse is not None and lse.shape == (2, hq, lq) and lse.dtype == torch.float32
    for got, want in zip(grads, ref_grads):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_flash_kernels_are_counted_like_the_cpu_kernel(fake_flash):
    """flash-attn's calls add the same FLOPs as the CPU flash kernel's registered formula, so
    MFU does not read low on a GPU (FlopCounterMode alone counts them as 0)."""
    from tspbench.runtime.flops import counter

    q, k, v, dout = (torch.randn(1, 4, 16, 8) for _ in range(4))
    totals = {}
    for backend in ("flash_attn", "cpu_flash"):
        with attention.forced(backend), counter() as c:
            out, lse = attention.causal_fwd(q, k, v)
            attention.causal_bwd(dout, q, k, v, out, lse)
        totals[backend] = c.get_total_flops()
    assert totals["flash_attn"] == totals["cpu_flash"] > 0
    assert attention.FLOP_LISTENERS == []  # the counter unregistered on exit


@pytest.mark.skipif(bool(torch.version.cuda or torch.version.hip), reason="needs a CPU-only torch")
def test_the_gpu_build_check_is_the_host_torch_unless_cells_run_in_an_image():
    """On this CPU-only torch a gpu: true sweep stops before any cell; under --sdm apptainer the
    image's torch runs the cells, so the host's is not the one to judge (each cell's --device
    cuda does, inside the image)."""
    from tspbench.core.config import ConfigError
    from tspbench.pipeline.cells import check_gpu_build

    with pytest.raises(ConfigError, match="built without CUDA or ROCm"):
        check_gpu_build({"gpu": True})
    check_gpu_build({"gpu": True}, in_image=True)
    check_gpu_build({"gpu": False})
