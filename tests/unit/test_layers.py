"""The shared RMSNorm (tspbench.core.layers.rms_norm): the plain fp32 formula's values and
gradients, while autograd keeps only x, the weight and the fp32 rstd (issue 16, "Norms")."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from tspbench.core.layers import rms_norm
from tspbench.core.memory import MemoryTracker

EPS = 1e-5


def plain(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """The formula the norm replaced, in plain autograd."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def _inputs(dtype: torch.dtype, shape=(2, 5, 16)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype).requires_grad_()
    return x, w


def _run(norm, x, w, dy):
    x.grad = w.grad = None
    y = norm(x, w)
    y.backward(dy)
    return y, x.grad, w.grad


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_values_and_gradients_equal_the_plain_formula(dtype, tol):
    x, w = _inputs(dtype)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = [t.clone() for t in _run(plain, x, w, dy)]
    got = _run(lambda x, w: rms_norm(x, w, EPS), x, w, dy)
    for name, g, r in zip(("y", "dx", "dweight"), got, want):
        assert g.dtype == r.dtype == dtype and g.shape == r.shape, name
        torch.testing.assert_close(g, r, atol=tol * r.abs().max().item(), rtol=tol, msg=name)


def _saved(norm, x, w) -> list[torch.Tensor]:
    saved: list[torch.Tensor] = []
    with saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        norm(x, w)
    return saved


def _bytes(ts: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages among ``ts`` (a tensor saved twice counts once)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts}.values())


def test_saves_only_x_weight_and_fp32_rstd():
    x, w = _inputs(torch.bfloat16)
    saved = _saved(lambda x, w: rms_norm(x, w, EPS), x, w)
    assert [(t.dtype, tuple(t.shape)) for t in saved] == [
        (torch.bfloat16, (2, 5, 16)),
        (torch.bfloat16, (16,)),
        (torch.float32, (2, 5, 1)),
    ]
    assert saved[0].data_ptr() == x.data_ptr() and saved[1].data_ptr() == w.data_ptr()
    lean, old = _bytes(saved), _bytes(_saved(plain, x, w))
    assert lean == x.nbytes + w.nbytes + 4 * 10
    assert old == 2 * 4 * x.numel() + 4 * 10 + 4 * 16  # fp32 x, rstd, x * rstd, fp32 weight
    assert lean < old / 3


def test_no_grad_saves_nothing_and_matches():
    x, w = _inputs(torch.bfloat16)
    with torch.no_grad():
        assert _saved(lambda x, w: rms_norm(x, w, EPS), x, w) == []
        y = rms_norm(x, w, EPS)
    assert y.grad_fn is None and torch.equal(y, plain(x, w).detach())


def test_weight_only_and_checkpointed_gradients():
    x, w = _inputs(torch.float32)
    dy = torch.ones(x.shape)
    x0 = x.detach()  # only the weight needs a gradient
    (rms_norm(x0, w, EPS) * dy).sum().backward()
    dw = w.grad.clone()
    _, dx_ref, dw_ref = _run(plain, x, w, dy)
    torch.testing.assert_close(dw, dw_ref, atol=1e-6, rtol=1e-6)
    w.grad = None
    y = checkpoint(lambda x, w: rms_norm(x, w, EPS), x, w, use_reentrant=False)
    x.grad = None
    y.backward(dy)
    torch.testing.assert_close(x.grad, dx_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(w.grad, dw_ref, atol=1e-6, rtol=1e-6)


def test_runs_under_fake_tensors_and_dispatch_modes():
    with FakeTensorMode():
        x, w = _inputs(torch.bfloat16)
        y = rms_norm(x, w, EPS)
        y.sum().backward()
        assert (y.dtype, x.grad.dtype, w.grad.shape) == (torch.bfloat16, torch.bfloat16, (16,))
    x, w = _inputs(torch.bfloat16)
    with MemoryTracker() as mem, FlopCounterMode(display=False):
        rms_norm(x, w, EPS).sum().backward()
    assert mem.peak > 0 and x.grad is not None and w.grad is not None
