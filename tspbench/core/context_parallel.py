"""Context parallelism's per-sequence pieces, shared by SP, TP+SP and FSDP+CP: RoPE tables at the
zigzag tokens' global positions, and layer hooks that all-gather K/V along the sequence (reduce-
scatter in backward) and run zigzag causal attention."""

from __future__ import annotations

import torch

from tspbench.core import zigzag
from tspbench.core.attention import attention
from tspbench.core.collectives import GatherSequence
from tspbench.core.comm import Comm
from tspbench.core.config import ModelConfig
from tspbench.core.layers import LayerHooks, cached, rope_tables


def zigzag_rope(
    seq_len: int, comm: Comm, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of this rank's zigzag tokens (global positions)."""
    pos = zigzag.positions(seq_len, comm.size, comm.rank)
    cos, sin = rope_tables(pos, cfg.head_dim, cfg.rope_theta, dtype)
    return cos.to(device), sin.to(device)


def cp_tables(
    owner: object, seq_len: int, comm: Comm, cfg: ModelConfig, like: torch.Tensor, **tp_hooks
) -> tuple[torch.Tensor, torch.Tensor, LayerHooks]:
    """(cos, sin, hooks) of context parallelism over ``comm`` at ``seq_len`` for activations
    like ``like``: :func:`zigzag_rope` and :func:`context_parallel_hooks`, built once and kept
    with ``owner`` (:func:`tspbench.core.layers.cached`)."""
    device = like.device
    key = ("cp", seq_len, like.dtype, device, id(comm), *sorted(tp_hooks))
    return cached(owner, key, lambda: (
        *zigzag_rope(seq_len, comm, cfg, like.dtype, device),
        context_parallel_hooks(seq_len, comm, device, **tp_hooks),
    ))  # fmt: skip


def context_parallel_hooks(
    seq_len: int, comm: Comm, device: torch.device, **tp_hooks
) -> LayerHooks:
    """K/V all-gathered over ``comm`` in global order, zigzag attention; ``tp_hooks`` (enter,
    exit) add tensor parallelism inside."""
    D, r = comm.size, comm.rank
    to_g = zigzag.gathered_to_global(seq_len, D).to(device)
    to_r = zigzag.global_to_gathered(seq_len, D).to(device)

    def gather_kv(k: torch.Tensor, v: torch.Tensor):
        kv = GatherSequence.apply(torch.stack([k, v]), comm, 3, to_g, to_r)
        return kv[0], kv[1]

    return LayerHooks(
        gather_kv=gather_kv, attn=lambda q, k, v: attention(q, k, v, r, D), **tp_hooks
    )
