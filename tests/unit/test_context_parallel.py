"""Context parallelism over one rank (SP at D = 1, TP+SP at Sigma = 1) is plain attention: no
exchange hook, so no K/V is stacked, gathered or reordered, whatever ``cp_comm`` says."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tspbench.core.attention import attention
from tspbench.core.config import get_config
from tspbench.core.context_parallel import cp_tables
from tspbench.core.mesh import Axis, build_mesh


@pytest.fixture(scope="module")
def comm():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield build_mesh({Axis.MODEL: 1})[Axis.MODEL]
    dist.destroy_process_group()


@pytest.mark.parametrize("cp_comm", ["all_gather", "a2a", "ring"])
def test_one_rank_exchanges_nothing(comm, cp_comm):
    class Owner:
        pass

    cfg = get_config("tiny")
    like = torch.zeros(1, 32, cfg.hidden)
    _, _, hooks = cp_tables(Owner(), 32, comm, cfg, like, cp_comm=cp_comm)
    k, v = torch.randn(2, 1, cfg.kv_heads, 32, cfg.d_head).unbind(0)
    got_k, got_v = hooks.gather_kv(k, v)
    assert got_k is k and got_v is v  # as projected: no copy
    assert hooks.attn is attention
