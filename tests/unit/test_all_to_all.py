"""The Ulysses exchange's pieces that need no peers: Comm.all_to_all's counted bytes (on torch's
fake process group: 4 ranks, nothing moves) and cp_comm=a2a's one-line refusal of heads the
all-to-all cannot split, raised by validate before any collective."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from tspbench.core.comm import Comm, CommCounter, bus_bytes
from tspbench.core.config import ConfigError, get_config
from tspbench.core.strategy import Layout
from tspbench.runtime.registry import get_strategy


def test_bus_bytes_of_an_all_to_all():
    assert bus_bytes("all_to_all", 800, 4) == 600  # (D-1)/D of the tensor each rank sends
    assert bus_bytes("all_to_all", 800, 1) == 0


def test_all_to_all_counts_d_minus_1_over_d_of_its_tensor():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        counter = CommCounter()
        comm = Comm(None, [0, 1, 2, 3], "model", counter)
        t = torch.arange(24, dtype=torch.float32).view(4, 2, 3)  # 4 blocks of 24 bytes
        out = comm.all_to_all(t.transpose(1, 2))  # a strided input is made contiguous
        assert out.shape == (4, 3, 2)
        assert counter.bytes[("model", "all_to_all")] == 3 / 4 * 96
        assert counter.calls[("model", "all_to_all")] == 1
        pending = comm.all_to_all(t, async_op=True)
        assert pending.wait().shape == t.shape
        assert counter.by_kind() == {"all_to_all": 2 * 72.0}
        comm.skip = True  # compute alone: shaped zeros, nothing counted
        assert torch.equal(comm.all_to_all(t), torch.zeros_like(t))
        assert counter.calls[("model", "all_to_all")] == 2
    finally:
        dist.destroy_process_group()
    alone = Comm(None, [0], "model", CommCounter())  # a group of one: itself, uncounted
    assert torch.equal(alone.all_to_all(t), t) and not alone.counter.bytes


@pytest.mark.parametrize("name", ["sp", "fsdp_cp", "fsdp2_cp"])
@pytest.mark.parametrize(
    "model, needle",
    [
        ({"kv_heads": 2}, "model.kv_heads=2: must be divisible by D=4 for cp_comm=a2a"),
        ({"heads": 6, "kv_heads": 6, "hidden": 48}, "model.heads=6: must be divisible by D=4"),
    ],
)
def test_a2a_refuses_heads_it_cannot_split(name, model, needle):
    """One line naming the field, the value and the rule; the default exchange takes them."""
    assert not dist.is_initialized()
    cfg, impl = get_config("tiny", **model), get_strategy(name)
    with pytest.raises(ConfigError) as e:
        impl.validate(cfg, Layout(degree=4), 32, 2, cp_comm="a2a")
    assert needle in str(e.value) and "\n" not in str(e.value)
    impl.validate(cfg, Layout(degree=4), 32, 2, cp_comm="all_gather")


def test_tpsp_a2a_refuses_heads_it_cannot_split_over_sigma():
    """TP+SP's all-to-all splits a TP rank's H/T heads over Sigma: one line naming the rule."""
    cfg, impl, lay = get_config("tiny", kv_heads=2), get_strategy("tpsp"), Layout(4, tp=2, sp=2)
    with pytest.raises(ConfigError) as e:
        impl.validate(cfg, lay, 32, 2, cp_comm="a2a")
    assert "model.kv_heads=2: kv_heads/T = 1 must be divisible by sp=2" in str(e.value)
    impl.validate(cfg, lay, 32, 2, cp_comm="all_gather")
