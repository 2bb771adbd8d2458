"""Counter-based init: a shard's values are the same shard of the full tensor, bit for bit, and
generating a shard never builds the full tensor."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tspbench.core.config import ModelConfig
from tspbench.core.reference import init_param, init_param_flat, param_shapes

CFG = ModelConfig(hidden=64, layers=1, heads=4, kv_heads=2, ffn=96, vocab=128)


def test_blocks_and_flat_ranges_equal_the_full_tensor_bit_for_bit():
    full = init_param(CFG, "layers.0.w1", 3)  # [96, 64]
    cases = [
        (slice(10, 40), None),
        (None, slice(5, 37)),
        (slice(0, 96, 7), slice(1, 64, 3)),
        (torch.tensor([95, 0, 17, 17]), torch.tensor([63, 2, 8])),
    ]
    for rows, cols in cases:
        want = full[rows if rows is not None else slice(None)]
        want = want[:, cols if cols is not None else slice(None)]
        got = init_param(CFG, "layers.0.w1", 3, rows, cols)
        assert torch.equal(got, want), (rows, cols)
    for start, stop in [(0, 64), (50, 70), (63, 64 * 5 + 1), (6000, 96 * 64 + 9)]:
        got = init_param_flat(CFG, "layers.0.w1", 3, start, stop, "cpu")
        assert torch.equal(got, full.flatten()[start:stop]), (start, stop)


def test_values_depend_on_seed_and_name_only():
    a = init_param(CFG, "layers.0.wq", 0)
    assert not torch.equal(a, init_param(CFG, "layers.0.wk", 0)[:64])
    assert not torch.equal(a, init_param(CFG, "layers.0.wq", 1))
    assert torch.equal(init_param(CFG, "norm", 0), torch.ones(64))


def test_moments_of_a_large_tensor():
    cfg = ModelConfig(hidden=1024, layers=1, heads=8, kv_heads=8, ffn=2048, vocab=4096)
    w = init_param(cfg, "embed", 0).double()  # 4M elements
    assert abs(w.mean().item()) < 3e-3 * cfg.init_std
    assert abs(w.std().item() / cfg.init_std - 1) < 3e-3


class _Largest(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_a_shard_on_meta_never_builds_the_full_tensor():
    cfg = ModelConfig(hidden=4096, layers=1, heads=32, kv_heads=8, ffn=11008, vocab=32000)
    full = param_shapes(cfg)["embed"][0] * cfg.hidden
    with _Largest() as mode:
        t = init_param(cfg, "embed", 0, rows=slice(0, 4000), device="meta")
    assert t.shape == (4000, cfg.hidden)
    assert mode.largest <= 4000 * cfg.hidden < full
    with _Largest() as mode:
        t = init_param_flat(cfg, "embed", 0, 5, 5 + 3_000_000, "meta")
    assert mode.largest <= 3_000_000
