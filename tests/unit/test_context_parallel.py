"""Context parallelism over one rank (SP at D = 1, TP+SP at Sigma = 1) is plain attention: no
exchange hook, so no K/V is stacked, gathered or reordered, whatever ``cp_comm`` says; and
a2a+p2p's groups, token order and inner size."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tspbench.core import zigzag
from tspbench.core.attention import attention
from tspbench.core.config import ConfigError, get_config
from tspbench.core.context_parallel import cp_tables
from tspbench.core.exchange import a2a_sizes, check_exchange, inner_size
from tspbench.core.mesh import Axis, build_mesh, rank_grid, split_lines


@pytest.fixture(scope="module")
def comm():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield build_mesh({Axis.MODEL: 1})[Axis.MODEL]
    dist.destroy_process_group()


@pytest.mark.parametrize("cp_comm", ["all_gather", "a2a", "ring", "a2a+p2p"])
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


def test_split_lines_keep_inner_groups_consecutive():
    """a2a+p2p's groups: TP+SP 2 x 4 in a world of 16 (dp 2): the sp axis's lines are strided
    by T = 2; inner pairs are consecutive sp ranks, outer groups take one of each pair."""
    lines = rank_grid({Axis.DP: 2, Axis.SP: 4, Axis.TP: 2}).movedim(1, -1).reshape(-1, 4).tolist()
    inner, outer = split_lines(lines, 2)
    assert lines[0] == [0, 2, 4, 6]
    assert inner[:2] == [[0, 2], [4, 6]] and outer[:2] == [[0, 4], [2, 6]]
    assert (
        sorted(r for g in inner for r in g)
        == list(range(16))
        == sorted(r for g in outer for r in g)
    )
    with pytest.raises(ValueError, match="no inner groups of 3"):
        split_lines(lines, 3)


@pytest.mark.parametrize("D,a", [(4, 2), (8, 2), (8, 4), (6, 3), (12, 3)])
def test_an_inner_groups_zigzag_tokens_are_an_outer_zigzag_ranks(D, a):
    """The identity a2a+p2p rests on: the tokens of ranks ga..ga+a-1, put in the order a zigzag
    over a ranks puts its gathered tokens, are exactly outer rank g's tokens of a zigzag over
    D/a ranks (chunks a times as long), so ring attention runs over the groups unchanged."""
    S = 2 * D * 3  # three tokens per chunk
    for g in range(D // a):
        gathered = torch.cat([zigzag.positions(S, D, g * a + j) for j in range(a)])
        order = zigzag.gathered_to_global(S * a // D, a)
        assert torch.equal(gathered[order], zigzag.positions(S, D // a, g))


def test_inner_size_picks_the_largest_that_fits_and_names_the_rule():
    cfg = get_config("tiny")  # 8 heads, 8 kv heads
    assert a2a_sizes(cfg, 8) == (2, 4) and inner_size(cfg, 8, 1, 0) == 4
    assert inner_size(cfg, 8, 1, 2) == 2
    assert a2a_sizes(get_config("tiny", kv_heads=2), 8) == (2,)
    assert a2a_sizes(cfg, 8, tp=4) == (2,)  # 2 heads per TP rank
    with pytest.raises(ConfigError, match=r"^cp_a2a=0 \(the largest that fits\): none does"):
        inner_size(cfg, 2, 1, 0)
    with pytest.raises(ConfigError, match=r"^cp_a2a=8: must divide the context-parallel degree 8"):
        inner_size(cfg, 8, 1, 8)
    with pytest.raises(ConfigError, match=r"^cp_a2a=2: only with cp_comm=a2a\+p2p \(not ring\)"):
        check_exchange(cfg, 32, 4, "ring", cp_a2a=2)
