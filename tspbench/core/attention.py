"""One attention entry point: causal attention with a lower-right-aligned mask.

Geometry: queries q [B, Hq, Lq, d] are the *last* Lq positions of the keys k, v [B, Hkv, Lk, d]
(Lk >= Lq), so query i sees keys [0, Lk - Lq + i]. GQA is native (Hq a multiple of Hkv).
The functions return/consume the attention log-sum-exp so that a caller can write its own backward
(TSP re-gathers K/V in backward instead of saving the full-sequence copies).

Backends, picked per device:
- ``flash_attn``: CUDA/ROCm with flash-attn installed, fp16/bf16 only (its kernels take no
  fp32); ``causal=True`` is lower-right aligned. Forward returns out and log-sum-exp; backward
  calls flash-attn's own backward kernel with them (no recomputed forward), through an adapter
  that matches the installed version's argument names (:func:`_flash_bwd`).
- ``cpu_flash``: PyTorch's CPU flash kernel (what SDPA dispatches to on CPU); the mask is split
  into the unmasked prefix and the causal diagonal block, merged by log-sum-exp, so no [Lq, Lk]
  mask is materialised. Backward uses the kernel's own backward with the merged out/lse.
- ``torch_flash``: a GPU without a usable flash-attn, fp16/bf16: PyTorch's own
  FlashAttention-2 kernels (``aten._scaled_dot_product_flash_attention`` and its backward, as
  torch's own context parallelism calls them), which return the log-sum-exp and align a causal
  mask lower-right; so a GPU image without flash-attn keeps flash's memory and its backward
  kernel (no recomputed forward, no written-out ring block).
- ``sdpa``: any other case (fp32 on a GPU, a GPU without torch's flash kernels):
  ``scaled_dot_product_attention`` with ``causal_lower_right``; backward recomputes through
  autograd.
- ``fused`` (only under :func:`forced`, only on fake tensors): one kernel call per block, shaped
  like flash-attn's (out and lse, no [Lq, Lk] buffer), so the fake-tensor estimator sees a GPU
  flash kernel's memory. Its mask is top-left aligned: values would be wrong, shapes are right.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from tspbench.core import recompute

_aten = torch.ops.aten
HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None  # installed (maybe broken)
FLASH_MIN = (2, 1)  # causal=True is lower-right aligned from flash-attn 2.1 (top-left before)
BACKENDS = ("flash_attn", "torch_flash", "cpu_flash", "sdpa", "fused")
_forced: str | None = None


@contextmanager
def forced(backend: str | None) -> Iterator[None]:
    """Use ``backend`` whatever the device (the estimator's choice of kernel); None: no change."""
    global _forced
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r}: must be one of {', '.join(BACKENDS)}")
    old, _forced = _forced, backend or _forced
    try:
        yield
    finally:
        _forced = old


FLASH_DTYPES = (torch.float16, torch.bfloat16)
# FLOP counters listening for the kernels torch's FlopCounterMode cannot see: flash-attn's are a
# C++ extension call (or a custom op without a formula). The runtime's counter registers here.
FLOP_LISTENERS: list[Callable[[str, int], None]] = []


def causal_pairs(lq: int, lk: int, lower_right: bool = True) -> int:
    """(query, key) pairs a causal call of Lq queries over Lk keys computes: what FLOPs are
    counted by, for every strategy alike (a full mask's Lq x Lk would count a causal call at
    D = 1 twice over, and zigzag chunks, with fewer masked pairs, less so)."""
    if not lower_right:  # top-left: query i sees keys [0, i]
        m = min(lq, lk)
        return m * (m + 1) // 2 + (lq - m) * lk
    if lq <= lk:  # query i sees keys [0, Lk - Lq + i]
        return lq * (lk - lq) + lq * (lq + 1) // 2
    return lk * (lk + 1) // 2


def _count_flash(kind: str, q: torch.Tensor, k: torch.Tensor, causal: bool = True) -> None:
    """Tell the listeners a flash-attn call's FLOPs, by torch's SDPA formulas over the causal
    (lower-right) call's pairs (``causal=False``: every pair), as the CPU kernels are counted:
    4 b h d per pair forward, 2.5 times that backward."""
    if not FLOP_LISTENERS:
        return
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    b, h, s_q, d = q.shape
    s_k = k.shape[-2]
    qs, ks = (b, h, s_q, d), (b, h, s_k, d)
    n = (
        sdpa_flop_count(qs, ks, ks)
        if kind == "forward"
        else sdpa_backward_flop_count(qs, qs, ks, ks)
    )
    if causal:
        n = n * causal_pairs(s_q, s_k) // (s_q * s_k)
    for listen in FLOP_LISTENERS:
        listen(f"flash_attn.{kind}", n)


@functools.cache
def flash_attn_problem() -> str | None:
    """Why the installed flash-attn cannot be used (None: it can). A wheel built against
    another torch imports with an undefined symbol, and a release before 2.1 aligns its causal
    mask top-left (wrong for zigzag chunks, Lq < Lk): either falls back to SDPA, and
    ``tspbench doctor`` prints the reason, rather than failing in the first attention call."""
    if not HAS_FLASH_ATTN:
        return "flash-attn is not installed"
    try:
        import flash_attn
        import flash_attn.flash_attn_interface  # noqa: F401  (the compiled extension loads here)
    except Exception as e:  # an ImportError, or the OSError of an ABI-mismatched extension
        return f"flash-attn does not import ({type(e).__name__}: {e})"
    version = getattr(flash_attn, "__version__", None)
    if version is None:
        return "flash-attn has no __version__ (not a release)"
    try:
        release = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        return f"flash-attn version {version!r} is not a release number"
    if release < FLASH_MIN:
        return f"flash-attn {version} aligns causal masks top-left (needs >= 2.1)"
    return None


ENV = "TSPBENCH_ATTENTION"  # a kernel chosen by the user for every call (comparing kernels)


def env_backend() -> str | None:
    """The kernel ``$TSPBENCH_ATTENTION`` names (None: unset), or ConfigError naming the rule."""
    name = os.environ.get(ENV) or None
    if name is not None and name not in BACKENDS[:-1]:  # "fused" only shapes fake tensors
        from tspbench.core.config import ConfigError

        raise ConfigError(f"{ENV}={name!r}: must be one of {', '.join(BACKENDS[:-1])}")
    return name


def env_backend_problem(device_type: str, dtype: torch.dtype) -> str | None:
    """Why the kernel ``$TSPBENCH_ATTENTION`` names cannot run here (None: it can, or none is
    named): checked before a run starts, not at its first attention call."""
    name = env_backend()
    if name is None or name == "sdpa":
        return None
    where = f"{ENV}={name!r}"
    if name == "cpu_flash":
        return None if device_type == "cpu" else f"{where}: runs on a CPU only"
    if device_type != "cuda":
        return f"{where}: needs a GPU (this run is on the {device_type})"
    if dtype not in FLASH_DTYPES:
        run = str(dtype).removeprefix("torch.")
        return f"{where}: takes fp16 and bf16 only (this run is {run})"
    problem = (
        flash_attn_problem()
        if name == "flash_attn"
        else torch_flash_problem(torch.device("cuda", 0))
    )
    return f"{where}: {problem}" if problem else None


def backend_for(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """The kernel this module uses on ``device`` for ``dtype`` (``$TSPBENCH_ATTENTION`` first,
    then the best this device has)."""
    if _forced is not None:
        return _forced
    if (chosen := env_backend()) is not None:
        return chosen
    if device.type == "cuda" and dtype in FLASH_DTYPES:
        if flash_attn_problem() is None:
            return "flash_attn"
        if torch_flash_problem(device) is None:
            return "torch_flash"
    if device.type == "cpu":
        return "cpu_flash"
    return "sdpa"


@functools.cache
def torch_flash_problem(device: torch.device) -> str | None:
    """Why PyTorch's own flash kernels cannot run on ``device`` (None: they can): a build
    without them, or a GPU older than the kernels (CUDA compute capability 8.0)."""
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch has no flash attention kernels"
    major, minor = torch.cuda.get_device_capability(device)
    if torch.version.cuda and major < 8:
        return f"compute capability {major}.{minor} (torch's flash kernels need 8.0)"
    return None


def _require_fake(t: torch.Tensor) -> None:
    if not isinstance(t, FakeTensor):
        raise RuntimeError("the 'fused' attention backend only shapes fake tensors (estimator)")


def _cpu_block(q, k, v, causal):
    return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)


def _sdpa(q, k, v):
    lq, lk = q.shape[-2], k.shape[-2]
    if lq == lk:  # both alignments agree: SDPA's own causal flag, no mask object
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_lower_right(lq, lk), enable_gqa=True)


@functools.lru_cache(maxsize=256)
def _lower_right(lq: int, lk: int) -> torch.Tensor:
    """torch's lower-right ``CausalBias`` for (lq, lk), made outside any dispatch mode: it is a
    tensor subclass, and under a TorchDispatchMode (the memory tracker, the FLOP counter) its
    construction raises "raw Tensor object is already associated to a python object" (torch
    2.11 on the first H200 run: every sdpa run failed at its first step). It holds no data."""
    from torch.nn.attention.bias import causal_lower_right
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return causal_lower_right(lq, lk)


def _torch_flash(q, k, v, causal=True):
    """(out [B, Hq, Lq, d], lse [B, Hq, Lq] fp32) from PyTorch's FlashAttention-2 op; GQA is
    native (K/V heads divide Q heads), and causal is lower-right (FlashAttention-2's rule)."""
    out, lse = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
    return out, lse


@functools.cache
def _no_dropout_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (philox seed, offset) the forward returns without dropout, which its backward takes
    (read once from a tiny call, outside any dispatch mode, rather than guessed)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad():
        x = torch.zeros(1, 1, 8, 8, device=device, dtype=torch.bfloat16)
        rest = _aten._scaled_dot_product_flash_attention(x, x, x, 0.0, True)
    return rest[6], rest[7]


def _torch_flash_bwd(dout, q, k, v, out, lse, causal=True):
    """(dq, dk, dv) of :func:`_torch_flash`'s call, by the op's own backward kernel."""
    seed, offset = _no_dropout_state(q.device)
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
        _last_dim_dense(dout), q, k, v, out, lse, None, None, q.shape[-2], k.shape[-2], 0.0,
        causal, seed, offset,
    )  # fmt: skip
    return dq, dk, dv


def _last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied only where its last dimension is strided (flash kernels need it dense)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _flash(q, k, v, causal=True):
    """(out [B, Hq, Lq, d], lse [B, Hq, Lq] fp32) from flash-attn's public function (it works in
    [B, L, H, d]; with ``return_attn_probs`` it also returns the log-sum-exp)."""
    from flash_attn import flash_attn_func

    out, lse, _ = flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
        return_attn_probs=True,
    )  # fmt: skip
    return out.transpose(1, 2), lse


def _flash_bwd(dout, q, k, v, out, lse, causal=True):
    """flash-attn's backward kernel for :func:`_flash`'s call. Its private entry point's
    arguments changed between releases (``window_size`` became ``window_size_left/right``,
    ``softcap`` and ``deterministic`` appeared, and from 2.6.3 it is a torch custom op): they
    are passed by name, as its signature has them, so one adapter covers 2.5 to 2.8."""
    import inspect

    from flash_attn import flash_attn_interface as fa

    t = [x.transpose(1, 2).contiguous() for x in (dout, q, k, v, out)]
    dq, dk, dv = (torch.empty_like(x) for x in t[1:4])
    values = {
        "dout": t[0], "q": t[1], "k": t[2], "v": t[3], "out": t[4], "softmax_lse": lse,
        "dq": dq, "dk": dk, "dv": dv, "dropout_p": 0.0, "softmax_scale": q.shape[-1] ** -0.5,
        "causal": causal, "window_size": (-1, -1), "window_size_left": -1, "window_size_right": -1,
        "softcap": 0.0, "alibi_slopes": None, "deterministic": False, "rng_state": None,
    }  # fmt: skip
    # from flash-attn 2.6.3 (torch >= 2.4) the kernel is a torch.library custom op whose own
    # signature is (*args, **kwargs): its Python function, _init_fn, has the names
    fn = fa._flash_attn_backward
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    missing = [n for n, p in params.items() if n not in values and p.default is p.empty]
    if missing:
        raise RuntimeError(f"flash-attn {fa.__name__}: unknown backward arguments {missing}")
    fn(**{n: values[n] for n in params if n in values})
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def causal_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [B, Hq, Lq, d], lse [B, Hq, Lq] fp32 or None) of lower-right causal attention."""
    backend = backend_for(q.device, q.dtype)
    with torch.no_grad():
        if backend == "fused":
            _require_fake(q)
            return _cpu_block(q, k, v, True)
        if backend == "cpu_flash":
            lq, lk = q.shape[-2], k.shape[-2]
            if lq == lk:
                return _cpu_block(q, k, v, True)
            p = lk - lq
            o1, l1 = _cpu_block(q, k[:, :, :p], v[:, :, :p], False)
            o2, l2 = _cpu_block(q, k[:, :, p:], v[:, :, p:], True)
            lse = torch.logaddexp(l1, l2)
            out = (
                o1.float() * (l1 - lse).exp()[..., None] + o2.float() * (l2 - lse).exp()[..., None]
            )
            return out.to(q.dtype), lse
        if backend == "flash_attn":
            _count_flash("forward", q, k)
            return _flash(q, k, v)
        if backend == "torch_flash":
            return _torch_flash(q, k, v)
        return _sdpa(q, k, v), None


def causal_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) for :func:`causal_fwd`, given its saved out and lse."""
    backend = backend_for(q.device, q.dtype)
    if backend == "fused":
        _require_fake(q)
        bwd = _aten._scaled_dot_product_flash_attention_for_cpu_backward
        return bwd(dout, q, k, v, out, lse, 0.0, True)
    if backend == "cpu_flash":
        lq, lk = q.shape[-2], k.shape[-2]
        bwd = _aten._scaled_dot_product_flash_attention_for_cpu_backward
        if lq == lk:
            return bwd(dout, q, k, v, out, lse, 0.0, True)
        p = lk - lq
        dq1, dk1, dv1 = bwd(dout, q, k[:, :, :p], v[:, :, :p], out, lse, 0.0, False)
        dq2, dk2, dv2 = bwd(dout, q, k[:, :, p:], v[:, :, p:], out, lse, 0.0, True)
        return dq1 + dq2, torch.cat([dk1, dk2], dim=2), torch.cat([dv1, dv2], dim=2)
    if backend == "flash_attn":
        _count_flash("backward", q, k)
        return _flash_bwd(dout, q, k, v, out, lse)
    if backend == "torch_flash":
        assert lse is not None  # causal_fwd returned it
        return _torch_flash_bwd(dout, q, k, v, out, lse)
    with torch.enable_grad():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        with recompute.recomputing():  # forward's again: no model FLOPs
            out = _sdpa(qq, kk, vv)
        grads = torch.autograd.grad(out, (qq, kk, vv), dout)
    return grads[0], grads[1], grads[2]


def _math_block(q, k, v, causal):
    """(out, lse fp32) of one block written out (fp32 scores, K/V heads repeated for GQA): the
    ``sdpa`` backend's ring block, since SDPA returns no log-sum-exp to merge by."""
    g = q.shape[1] // k.shape[1]
    kk, vv = (t.float().repeat_interleave(g, dim=1) for t in (k, v))
    s = (q.float() @ kk.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    lse = s.logsumexp(-1)
    return ((s - lse[..., None]).exp() @ vv).to(q.dtype), lse


def _math_block_bwd(dout, q, k, v, out, lse, causal):
    """(dq, dk, dv) of :func:`_math_block` given the merged out and lse: the flash backward's
    formulas (P = exp(S - lse), dS = P (dP - rowsum(dO O))), K/V's summed over their group."""
    g, scale = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
    qf, do = q.float(), dout.float()
    kk, vv = (t.float().repeat_interleave(g, dim=1) for t in (k, v))
    s = (qf @ kk.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    p = (s - lse[..., None]).exp()
    ds = p * (do @ vv.transpose(-1, -2) - (do * out.float()).sum(-1, keepdim=True)) * scale
    dk = (ds.transpose(-1, -2) @ qf).unflatten(1, (-1, g)).sum(2)
    dv = (p.transpose(-1, -2) @ do).unflatten(1, (-1, g)).sum(2)
    return (ds @ kk).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def block_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse [B, Hq, Lq] fp32) of one block of ring attention: every query over every key,
    or (``causal``) a square block's causal mask. Unlike :func:`causal_fwd` the log-sum-exp
    is always there, since the ring merges its blocks' partial outputs by it."""
    backend = backend_for(q.device, q.dtype)
    with torch.no_grad():
        if backend == "fused":
            _require_fake(q)
        if backend in ("fused", "cpu_flash"):
            return _cpu_block(q, k, v, causal)
        if backend == "flash_attn":
            _count_flash("forward", q, k, causal)
            return _flash(q, k, v, causal)
        if backend == "torch_flash":
            return _torch_flash(q, k, v, causal)
        return _math_block(q, k, v, causal)


def block_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one :func:`block_fwd` block, given the merged output and log-sum-exp of
    all blocks (what makes each block's share of the gradient exact)."""
    backend = backend_for(q.device, q.dtype)
    if backend == "fused":
        _require_fake(q)
    if backend in ("fused", "cpu_flash"):
        bwd = _aten._scaled_dot_product_flash_attention_for_cpu_backward
        return bwd(dout, q, k, v, out, lse, 0.0, causal)
    if backend == "flash_attn":
        _count_flash("backward", q, k, causal)
        return _flash_bwd(dout, q, k, v, out, lse, causal)
    if backend == "torch_flash":
        return _torch_flash_bwd(dout, q, k, v, out, lse, causal)
    return _math_block_bwd(dout, q, k, v, out, lse, causal)


def zigzag_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, degree: int
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Attention of a rank's zigzag-local queries over the whole sequence's K/V (global order).

    Local query chunk j (global chunk index r or 2D-1-r) sees keys [0, (j+1) * S/(2D)).
    Returns (out, per-chunk lse list) for :func:`zigzag_bwd`.
    """
    if degree == 1:
        out, lse = causal_fwd(q, k, v)
        return out, [lse]
    c = q.shape[-2] // 2
    outs, lses = [], []
    for j, qc in zip((rank, 2 * degree - 1 - rank), (q[:, :, :c], q[:, :, c:])):
        o, lse = causal_fwd(qc, k[:, :, : (j + 1) * c], v[:, :, : (j + 1) * c])
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=2), lses


def zigzag_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lses: list[torch.Tensor | None],
    rank: int,
    degree: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq local, dk and dv over the whole sequence) for :func:`zigzag_fwd`."""
    if degree == 1:
        return causal_bwd(dout, q, k, v, out, lses[0])
    c = q.shape[-2] // 2
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dqs = []
    for i, j in enumerate((rank, 2 * degree - 1 - rank)):
        s = slice(i * c, (i + 1) * c)
        n = (j + 1) * c
        dq_c, dk_c, dv_c = causal_bwd(
            dout[:, :, s], q[:, :, s], k[:, :, :n], v[:, :, :n], out[:, :, s], lses[i]
        )
        dqs.append(dq_c)
        dk[:, :, :n] += dk_c
        dv[:, :, :n] += dv_c
    return torch.cat(dqs, dim=2), dk, dv


class ZigzagAttention(torch.autograd.Function):
    """Differentiable :func:`zigzag_fwd`, for strategies that keep plain autograd around it."""

    @staticmethod
    def forward(ctx, q, k, v, rank: int, degree: int):
        out, lses = zigzag_fwd(q, k, v, rank, degree)
        ctx.save_for_backward(q, k, v, out, *[x for x in lses if x is not None])
        ctx.meta = (rank, degree, [x is not None for x in lses])
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, *saved = ctx.saved_tensors
        rank, degree, has = ctx.meta
        it = iter(saved)
        lses = [next(it) if h else None for h in has]
        dq, dk, dv = zigzag_bwd(dout.contiguous(), q, k, v, out, lses, rank, degree)
        return dq, dk, dv, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int = 0, degree: int = 1):
    """Differentiable zigzag-causal attention (degree 1: plain causal attention)."""
    return ZigzagAttention.apply(q, k, v, rank, degree)


def _math_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Lower-right causal attention written out in float64: the oracle of the alignment check."""
    q, k, v = (t.double() for t in (q, k, v))
    lq, lk = q.shape[-2], k.shape[-2]
    seen = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return s.masked_fill(~seen, float("-inf")).softmax(-1) @ v


@functools.cache
def causal_alignment_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this device's kernel cannot run zigzag chunks (None: it can). SDPA on some ROCm
    builds aligns a causal mask top-left when queries are fewer than keys, which makes every
    zigzag chunk silently wrong: one tiny call with 4 queries over 12 keys against the math
    oracle tells the alignments apart (query 0 sees 9 keys lower-right, 1 top-left)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (4, 12, 12))
    want = _math_causal(q, k, v)
    got, _ = causal_fwd(*(t.to(device=device, dtype=dtype) for t in (q, k, v)))
    err = float((got.double().cpu() - want).abs().max() / want.abs().max())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    if err <= tol:
        return None
    kernel = backend_for(device, dtype)
    return (
        f"attention kernel {kernel} on {device} ({str(dtype).removeprefix('torch.')}) does not "
        f"align its causal mask lower-right (error {err:.2g} against the math oracle, limit "
        f"{tol:g}): zigzag chunks would be wrong; refusing to run"
    )
