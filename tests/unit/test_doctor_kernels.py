"""The doctor's kernel check covers what the ring needs of a kernel: blocks merged by their
log-sum-exp equal the float64 oracle, forward and backward; a kernel whose log-sum-exp is off
fails the check, naming the ring blocks."""

from __future__ import annotations

import pytest
import torch

from tspbench.core import attention
from tspbench.pipeline.doctor import attention_check

CPU = torch.device("cpu")


def test_the_cpu_kernels_pass_with_their_ring_blocks():
    for kernel in ("cpu_flash", "sdpa"):
        assert "ring blocks merged by their log-sum-exp" in attention_check(CPU, kernel, "fp32")


def test_a_log_sum_exp_that_is_off_fails_the_ring_blocks(monkeypatch):
    real = attention.block_fwd

    def shifted(q, k, v, causal):
        out, lse = real(q, k, v, causal)
        return out, lse + 0.5  # what a kernel with another lse convention would return

    monkeypatch.setattr(attention, "block_fwd", shifted)
    with pytest.raises(AssertionError, match=r"ring blocks \w+: error"):
        attention_check(CPU, "cpu_flash", "fp32")
