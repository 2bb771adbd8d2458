"""Zigzag sequence partitioning: rank r of D keeps chunks r and 2D-1-r of 2D equal chunks.

The pairing balances causal attention work: early chunks attend to few keys, late chunks to many.
"""

from __future__ import annotations

import torch

from tspbench.core.config import ConfigError


def check_divisible(seq_len: int, degree: int) -> None:
    """Raise a ConfigError unless the sequence splits into 2*degree equal chunks."""
    if seq_len <= 0 or degree <= 0:
        raise ConfigError(f"seq_len={seq_len}, degree={degree}: both must be positive")
    if seq_len % (2 * degree):
        raise ConfigError(
            f"seq_len={seq_len}: must be divisible by 2*D={2 * degree} for zigzag sharding "
            f"(D={degree})"
        )


def chunk_ids(rank: int, degree: int) -> tuple[int, int]:
    """The two global chunk indices that ``rank`` holds, in local order."""
    return rank, 2 * degree - 1 - rank


def positions(seq_len: int, degree: int, rank: int) -> torch.Tensor:
    """Global token positions of ``rank``'s local tokens, in local order."""
    check_divisible(seq_len, degree)
    c = seq_len // (2 * degree)
    a, b = chunk_ids(rank, degree)
    return torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)])


def shard(x: torch.Tensor, degree: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's zigzag shard of ``x`` along ``dim`` (a copy)."""
    return x.index_select(dim, positions(x.shape[dim], degree, rank).to(x.device))


def gathered_to_global(seq_len: int, degree: int) -> torch.Tensor:
    """Index that reorders a rank-ordered concat of local shards into global sequence order."""
    order = torch.cat([positions(seq_len, degree, r) for r in range(degree)])
    return torch.argsort(order)


def global_to_gathered(seq_len: int, degree: int) -> torch.Tensor:
    """Index that reorders a global sequence into rank-ordered concat of local shards."""
    return torch.cat([positions(seq_len, degree, r) for r in range(degree)])


def unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard`: put every rank's local shard back in global order."""
    degree = len(shards)
    cat = torch.cat(shards, dim=dim)
    return cat.index_select(dim, gathered_to_global(cat.shape[dim], degree).to(cat.device))
