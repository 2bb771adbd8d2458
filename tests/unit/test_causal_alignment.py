"""The start-up check that a kernel aligns its causal mask lower-right (queries are the last
Lq of Lk positions): a top-left kernel, as PyTorch's own ``is_causal=True`` is and some ROCm
SDPA builds are with a mask, is refused before any step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tspbench.core import attention
from tspbench.core.config import ConfigError, get_config
from tspbench.runtime.run import _require_causal_alignment
from tspbench.runtime.spec import RunSpec


@pytest.fixture(autouse=True)
def fresh():
    attention.causal_alignment_problem.cache_clear()
    yield
    attention.causal_alignment_problem.cache_clear()


def _top_left(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("backend", ["cpu_flash", "sdpa"])
def test_the_suites_kernels_align_lower_right(backend):
    with attention.forced(backend):
        assert attention.causal_alignment_problem(torch.device("cpu"), torch.float32) is None


def test_a_top_left_kernel_is_found_and_refused(monkeypatch):
    monkeypatch.setattr(attention, "_sdpa", _top_left)
    with attention.forced("sdpa"):
        problem = attention.causal_alignment_problem(torch.device("cpu"), torch.float32)
        assert problem and "sdpa on cpu (float32) does not align its causal mask" in problem
        spec = RunSpec.make("tp", get_config("tiny"), degree=1, seq_len=16)
        with pytest.raises(ConfigError, match="zigzag chunks would be wrong; refusing to run"):
            _require_causal_alignment(torch.device("cpu"), spec)


@pytest.mark.parametrize("lq, lk", [(8, 24), (8, 8)])
def test_the_sdpa_backend_runs_under_the_tracker_and_the_flop_counter(lq, lk):
    """What the first H200 run hit: every sdpa step of a measured run ran under the memory
    tracker and the FLOP counter (dispatch modes), where torch's lower-right CausalBias, a
    tensor subclass, could not be made. Forward and backward equal the CPU flash kernel's."""
    from tspbench.core.memory import MemoryTracker
    from tspbench.runtime.flops import counter

    attention._lower_right.cache_clear()  # made for the first time inside the modes
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(1, 4, lq, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 2, lk, 16, generator=g) for _ in range(2))
    with attention.forced("cpu_flash"):
        ref, ref_lse = attention.causal_fwd(q, k, v)
        ref_grads = attention.causal_bwd(do, q, k, v, ref, ref_lse)
    flops = counter()
    with attention.forced("sdpa"), MemoryTracker() as tracker, flops:
        out, lse = attention.causal_fwd(q, k, v)
        grads = attention.causal_bwd(do, q, k, v, out, lse)
    torch.testing.assert_close(out, ref)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)
    assert tracker.peak > 0 and flops.get_total_flops() > 0
