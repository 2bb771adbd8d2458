"""One FLOP rule for every strategy (issue 28): causal attention counts the (query, key) pairs
its mask keeps, and recomputed work is executed but not model FLOPs, so that MFU compares
strategies on the same work. Before, a causal call counted its full Lq x Lk (2.00x the useful
FLOPs at D = 1, 1.06x for zigzag chunks at D = 8) and recomputation counted as model work."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint

from tspbench.core import attention, recompute
from tspbench.core.config import get_config
from tspbench.projection import analytic
from tspbench.runtime.flops import counter
from tspbench.runtime.spec import RunSpec

B, H, S, d = 1, 2, 48, 8


def _qkv(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, d, generator=g, requires_grad=True) for _ in range(3)]


def _counted(fn) -> int:
    with counter() as c:
        fn().sum().backward()
    return c.model_flops()


@pytest.mark.parametrize("lq, lk, lower_right, want", [
    (4, 4, True, 10), (4, 4, False, 10), (2, 6, True, 5 + 6), (2, 6, False, 3),
    (6, 2, True, 3), (6, 2, False, 1 + 2 * 5), (1, 9, True, 9),
])  # fmt: skip
def test_causal_pairs(lq, lk, lower_right, want):
    """Sum over queries of the keys each sees (lower-right: query i sees Lk - Lq + i + 1)."""
    assert attention.causal_pairs(lq, lk, lower_right) == want


def test_one_causal_call_and_zigzag_chunks_count_the_same_pairs():
    """S(S+1)/2 pairs, forward 4 d per pair and head, backward 2.5x that, whether one call
    over S (D = 1) or D ranks' zigzag chunks, each a prefix and a diagonal block on CPU."""
    want = 7 * B * H * d * S * (S + 1)  # (4 + 10) B H d S(S+1)/2
    q, k, v = _qkv()
    assert _counted(lambda: attention.attention(q, k, v)) == want
    for D in (2, 3):
        c = S // (2 * D)
        total = 0
        for r in range(D):
            rows = torch.cat([torch.arange(r * c, (r + 1) * c),
                              torch.arange((2 * D - 1 - r) * c, (2 * D - r) * c)])  # fmt: skip
            ql = q.detach()[:, :, rows].requires_grad_()
            total += _counted(lambda ql=ql, r=r, D=D: attention.attention(ql, k, v, r, D))
        assert total == want, D


def test_sdpa_is_causal_counts_its_pairs():
    q, k, v = _qkv()
    n = _counted(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert n == 7 * B * H * d * S * (S + 1)
    full = _counted(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    assert full == 14 * B * H * d * S * S


def test_recomputed_work_is_executed_not_model():
    """A checkpointed layer's recomputed forward (the mark every strategy's checkpoint sets)
    counts in the executed total only."""
    w = torch.randn(d, d, requires_grad=True)
    x = torch.randn(S, d, requires_grad=True)
    layer = lambda x: torch.tanh(x @ w) @ w  # noqa: E731
    with counter() as plain:
        layer(x).sum().backward()
    with counter() as rc:
        torch.utils.checkpoint.checkpoint(
            layer, x, use_reentrant=False, context_fn=recompute.contexts
        ).sum().backward()
    assert rc.model_flops() == plain.model_flops() == plain.get_total_flops()
    # recomputed: x @ w only (autograd stops once the last GEMM's saved inputs are back)
    assert rc.get_total_flops() == plain.get_total_flops() + 2 * S * d * d


@pytest.mark.parametrize("rc", ["none", "full"])
def test_strategies_count_the_same_model_flops_for_the_same_work(rc):
    """7B at 128K, one sequence: single (D = 1), TSP and TP at D = 2 and TSP at D = 8, summed
    over the model group, count the same model FLOPs (executed ones differ by recomputation)."""
    cfg = get_config("7b")

    def total(strategy: str, D: int) -> int:
        c = RunSpec.make(strategy, cfg, degree=D, seq_len=131072, dtype="bf16", recompute=rc)
        return D * analytic.flops(c)

    ref = total("single", 1)
    for strategy, D in (("tsp", 2), ("tp", 2), ("tsp", 8), ("sp", 8)):
        assert total(strategy, D) == ref, (strategy, D)


EFF = (None, None, None, None, None, 0.0)  # bias .. dropout_p, then custom_mask_type


@pytest.mark.parametrize("op, args, layout, want", [
    ("_scaled_dot_product_efficient_attention", (None, False, 0.0, True), "bhld", (4, 12, False)),
    ("_scaled_dot_product_flash_attention", (0.0, True), "bhld", (4, 12, True)),
    ("_scaled_dot_product_flash_attention", (0.0, False), "bhld", None),
    ("_flash_attention_forward", (None, None, 4, 12, 0.0, True, False), "blhd", (4, 12, True)),
    ("_efficient_attention_forward", (*EFF, 2), "blhd", (4, 12, True)),
    ("_efficient_attention_forward", (*EFF, 1), "blhd", (4, 12, False)),
    ("_efficient_attention_forward", (*EFF, 0), "blhd", None),
])  # fmt: skip
def test_gpu_attention_ops_count_their_causal_pairs(op, args, layout, want):
    """The GPU kernels' ops (not run here) are scaled by their own causal argument and
    alignment: SDPA's efficient op's is_causal is top-left; flash's kernels are lower-right
    (torch's SDPA never sends them a non-square causal call, its CausalBias lower-right path
    does); the efficient kernels say which in ``custom_mask_type``; without a causal mask the
    formula's count stands."""
    from tspbench.runtime.flops import causal_share

    shape = {"bhld": lambda n: (1, 2, n, 8), "blhd": lambda n: (1, n, 2, 8)}[layout]
    q, k = torch.empty(shape(4), device="meta"), torch.empty(shape(12), device="meta")
    full = 1000 * 4 * 12
    n = causal_share(getattr(torch.ops.aten, op), full, (q, k, k, *args), {})
    assert n == (full if want is None else 1000 * attention.causal_pairs(*want))
