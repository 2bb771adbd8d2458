"""A stand-in for the ``flash_attn`` package, written in plain PyTorch math, so that the code
that calls flash-attn (layouts, the log-sum-exp, the backward adapter's argument mapping) is
tested on a CPU. It checks the plumbing, not flash-attn's kernels: ``tspbench doctor`` does
that on a GPU. ``install(tmp, variant)`` writes the package; ``variant`` picks the backward
signature of flash-attn 2.5 (``window_size``) or 2.7 (``window_size_left/right``, ``softcap``).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

_INIT = '''
import torch

__version__ = "0.0-fake"


def _attn(q, k, v):
    """[B, L, H, d] causal attention, lower-right aligned; (out, lse [B, H, Lq]). Invisible to
    dispatch modes (FlopCounterMode), as a C++ extension's kernel is."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return _math(q, k, v)


def _math(q, k, v):
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    lq, lk = q.shape[-2], k.shape[-2]
    mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    s = s.masked_fill(~mask, float("-inf"))
    lse = s.logsumexp(-1)
    return (s.softmax(-1) @ v).transpose(1, 2), lse


def flash_attn_func(q, k, v, causal=False, return_attn_probs=False):
    assert causal
    out, lse = _attn(q, k, v)
    out = out.to(q.dtype)
    return (out, lse, None) if return_attn_probs else out
'''

_BWD = {
    "2.5": "dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, "
    "window_size, alibi_slopes, deterministic, rng_state=None",
    "2.7": "dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, "
    "window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None",
}

_INTERFACE = """
import torch

from flash_attn import _math


def _flash_attn_backward({signature}):
    assert causal and dropout_p == 0.0
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.enable_grad():
        qq, kk, vv = (x.detach().float().requires_grad_() for x in (q, k, v))
        o, lse = _math(qq, kk, vv)
        assert torch.allclose(lse, softmax_lse, atol=1e-4), "the saved lse is not this call's"
        grads = torch.autograd.grad(o, (qq, kk, vv), dout.float())
    for buf, g in zip((dq, dk, dv), grads):
        buf.copy_(g)
    return dq, dk, dv, None
"""


def install(root: Path, variant: str = "2.7") -> Path:
    pkg = root / "flash_attn"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(_INIT))
    interface = textwrap.dedent(_INTERFACE).replace("{signature}", _BWD[variant])
    (pkg / "flash_attn_interface.py").write_text(interface)
    return root
