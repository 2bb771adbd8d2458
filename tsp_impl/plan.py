"""What every TSP schedule needs to know about its rank: the group, the shapes, the zigzag."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tspbench.core import zigzag
from tspbench.core.comm import Comm
from tspbench.core.config import ModelConfig
from tspbench.core.layers import rope_tables


@dataclass
class TSPPlan:
    comm: Comm  # the folded axis: D ranks
    cfg: ModelConfig
    seq_len: int
    cos: torch.Tensor  # RoPE tables of this rank's local tokens' *global* positions
    sin: torch.Tensor
    to_global: torch.Tensor  # gathered (rank-major) sequence order -> global order
    to_gathered: torch.Tensor  # global order -> gathered order
    overlap: bool = True  # prefetch the next shard while computing on this one
    kv_bucket: int = 0  # KV heads per attention bucket (0: the whole head group at once)

    @classmethod
    def build(
        cls,
        comm: Comm,
        cfg: ModelConfig,
        seq_len: int,
        dtype: torch.dtype,
        device: torch.device,
        overlap: bool = True,
        kv_bucket: int = 0,
    ) -> TSPPlan:
        D, r = comm.size, comm.rank
        cos, sin = rope_tables(zigzag.positions(seq_len, D, r), cfg.head_dim, cfg.rope_theta, dtype)
        return cls(
            comm,
            cfg,
            seq_len,
            cos.to(device),
            sin.to(device),
            zigzag.gathered_to_global(seq_len, D).to(device),
            zigzag.global_to_gathered(seq_len, D).to(device),
            overlap,
            kv_bucket,
        )

    @property
    def D(self) -> int:
        return self.comm.size

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def hq(self) -> int:
        """Query heads per head group."""
        return self.cfg.heads // self.D

    @property
    def hkv(self) -> int:
        """KV heads per head group."""
        return self.cfg.kv_heads // self.D

    def buckets(self) -> list[tuple[slice, slice]]:
        """(query-head slice, kv-head slice) of each attention bucket of a head group.

        A bucket of b KV heads bounds the gathered K/V buffer to 2*B*b*S*d elements, at the price
        of hkv/b all-gathers per head group instead of one (same bytes, more latency).
        """
        b = self.kv_bucket or self.hkv
        g = self.hq // self.hkv  # query heads per KV head (GQA)
        return [(slice(i * g, (i + b) * g), slice(i, i + b)) for i in range(0, self.hkv, b)]
