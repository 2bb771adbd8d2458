"""Megatron's tensor-parallel split of the reference parameters (TP and TP+SP shard by it)."""

from __future__ import annotations

import torch

from tspbench.core.comm import Comm

# Megatron's split of every reference parameter: column-parallel weights by rows (dim 0),
# row-parallel weights (wo, w2) by columns, embedding and LM head by vocabulary rows, norms whole.
MEGATRON_SHARD_DIM = {"embed": 0, "head": 0, "wq": 0, "wk": 0, "wv": 0, "wo": 1, "w1": 0,
                      "w3": 0, "w2": 1, "bq": 0, "bk": 0, "bv": 0, "b1": 0, "b3": 0,
                      # experts: E/T whole experts per rank (expert parallel over the TP group);
                      # a shared expert split as the dense MLP; the router and its gate whole
                      "ew1": 0, "ew3": 0, "ew2": 0, "sw1": 0, "sw3": 0, "sw2": 1}  # fmt: skip
# (the column-parallel biases split with their weights' rows; the row-parallel ones, bo and b2,
# are whole on every rank, added after the reduction)


def shard_dim(name: str) -> int | None:
    """Megatron shard dim of a reference-named parameter (None: replicated)."""
    return MEGATRON_SHARD_DIM.get(name.rsplit(".", 1)[-1])


def gather_named(
    params: dict[str, torch.nn.Parameter], comm: Comm, grads: bool
) -> dict[str, torch.Tensor]:
    """Whole tensors from Megatron-sharded ``params`` (or their grads) over ``comm``."""
    out = {}
    for name, p in params.items():
        t = p.grad if grads else p
        assert t is not None, f"{name}: no gradient (gather grads after the backward)"
        t = t.detach()
        dim = shard_dim(name)
        out[name] = t if dim is None else comm.all_gather(t, dim=dim)
    return out


def head_partial(params: dict[str, torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The replicated parameters whose gradient each tensor-parallel rank holds only its part
    of (Qwen3's QK norms: its heads'; a router: its experts' tokens'; a shared expert's gate: its
    slice's output's): summed over the TP group after backward."""
    return [
        p
        for n, p in params.items()
        if n.rsplit(".", 1)[-1] in ("q_norm", "k_norm", "router", "sgate")
    ]
