"""A stand-in for the ``flash_attn`` package, written in plain PyTorch math, so that the code
that calls flash-attn (layouts, the log-sum-exp, the backward adapter's argument mapping) is
tested on a CPU. It checks the plumbing, not flash-attn's kernels: ``tspbench doctor`` does
that on a GPU. ``install(tmp, variant)`` writes the package; ``variant`` picks the backward
of flash-attn 2.5 (``window_size``), 2.7 as a plain function (``window_size_left/right``,
``softcap``) or 2.7.4 as flash-attn has shipped it since 2.6.3 with torch >= 2.4: a
``torch.library`` custom op, whose own signature is ``(*args, **kwargs)``. ``version`` sets
``__version__`` (default: the variant's).
"""

from __future__ import annotations

import hashlib
import textwrap
from pathlib import Path

_INIT = '''
import torch

__version__ = "{version}"


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


def _math_grads(q, k, v, dout):
    """(dq, dk, dv) of :func:`_math` by the softmax-attention formulas, without autograd (a
    custom op's body runs below it)."""
    g = q.shape[2] // k.shape[2]
    q, k, v, do = (x.transpose(1, 2).float() for x in (q, k, v, dout))
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scale = q.shape[-1] ** -0.5
    lq, lk = q.shape[-2], k.shape[-2]
    mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    p = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf")).softmax(-1)
    dv = p.transpose(-1, -2) @ do
    dp = do @ v.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq, dk = ds @ k * scale, ds.transpose(-1, -2) @ q * scale
    b, h, _, d = dk.shape
    dk, dv = (x.view(b, h // g, g, lk, d).sum(2) for x in (dk, dv))
    return tuple(x.transpose(1, 2) for x in (dq, dk, dv))


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
# flash-attn's own annotations (a custom op needs them), as in its flash_attn_interface.py
_BWD["2.7.4"] = (
    "dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, "
    "softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor], "
    "dv: Optional[torch.Tensor], dropout_p: float, softmax_scale: float, causal: bool, "
    "window_size_left: int, window_size_right: int, softcap: float, "
    "alibi_slopes: Optional[torch.Tensor], deterministic: bool, "
    "rng_state: Optional[torch.Tensor] = None"
)

_INTERFACE = """
from typing import Optional

import torch

from flash_attn import _math, _math_grads


{decorator}def _flash_attn_backward({signature}){returns}:
    assert causal and dropout_p == 0.0
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        _, lse = _math(q, k, v)
        assert torch.allclose(lse, softmax_lse, atol=1e-4), "the saved lse is not this call's"
        grads = _math_grads(q, k, v, dout)
    for buf, g in zip((dq, dk, dv), grads):
        buf.copy_(g)
    return {result}
"""
_OP = '@torch.library.custom_op("{ns}::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))\n'


def _namespace(root: Path) -> str:
    """An op namespace of this install's own: an op name registers once per process."""
    return "fake_flash_attn_" + hashlib.sha1(str(root).encode()).hexdigest()[:12]


def install(root: Path, variant: str = "2.7", version: str | None = None) -> Path:
    pkg = root / "flash_attn"
    pkg.mkdir(parents=True, exist_ok=True)
    version = version or (variant if variant.count(".") == 2 else variant + ".0")
    init = textwrap.dedent(_INIT).replace("{version}", version)
    (pkg / "__init__.py").write_text(init)
    op = variant == "2.7.4"
    interface = (
        textwrap.dedent(_INTERFACE)
        .replace("{signature}", _BWD[variant])
        .replace("{decorator}", _OP.replace("{ns}", _namespace(root)) if op else "")
        .replace("{returns}", " -> torch.Tensor" if op else "")
        .replace("{result}", "softmax_lse.clone()" if op else "dq, dk, dv, None")
    )
    (pkg / "flash_attn_interface.py").write_text(interface)
    return root
