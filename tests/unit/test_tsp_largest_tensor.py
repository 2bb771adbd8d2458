"""No TSP tensor is larger than what the method needs in flight (issue 16): one weight shard (a
vocabulary shard, the packed MLP slice or a head group's attention weights), one head group's
K/V over the whole sequence, or a local-token activation (fp32, at most max(h, f/D, V/D) wide).
In particular no rank builds a [V, h] embedding gradient: it is reduced owner by owner.

Every rank of a D=4 group runs a training step on fake tensors (torch's fake process group), so
the check is cheap and covers each rank's shapes."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tspbench.core.config import get_config
from tspbench.core.optim import AdamW
from tspbench.core.reference import make_batch
from tspbench.projection.estimate import fake_rank
from tspbench.runtime.measure import one_step
from tspbench.runtime.spec import RunSpec


class Largest(TorchDispatchMode):
    """The largest storage any op of the step creates, with the op that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes, self.op = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > self.nbytes:
                self.nbytes, self.op = t.untyped_storage().nbytes(), f"{func} {tuple(t.shape)}"
        return out


def bound(spec: RunSpec) -> int:
    cfg, D, e = spec.cfg, spec.layout.degree, 4  # fp32
    h, kv, f, V = cfg.hidden, cfg.kv_dim, cfg.ffn, cfg.vocab
    shard = max(V * h, 3 * f * h, (2 * cfg.q_dim + 2 * kv) * h) // D * e
    kv_group = 2 * spec.batch * spec.seq_len * (kv // D) * e
    t = spec.batch * spec.seq_len // D
    act = t * max(h, f // D, V // D) * 4
    return max(shard, kv_group, act)


@pytest.mark.parametrize("model,S", [("small", 64), ("tiny", 256)])
@pytest.mark.parametrize("mlp_schedule", ["ring", "broadcast"])
def test_no_tsp_tensor_exceeds_a_shard_in_flight(model, S, mlp_schedule):
    spec = RunSpec.make("tsp", get_config(model), degree=4, seq_len=S, mlp_schedule=mlp_schedule)
    limit = bound(spec)
    for rank in range(4):
        with fake_rank(spec, rank, kernel=None) as (_, strat):
            batch = strat.shard_batch(*make_batch(spec.cfg, 1, S, 0))
            opt = AdamW(strat.parameters())
            largest = Largest()
            with largest:
                one_step(strat, batch, opt)
        assert largest.nbytes <= limit, f"rank {rank}: {largest.op} {largest.nbytes} > {limit}"
