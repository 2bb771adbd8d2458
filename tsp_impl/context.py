"""What every TSP schedule needs to know about its rank: the group, the shapes, the zigzag."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tspbench.core import zigzag
from tspbench.core.comm import Comm
from tspbench.core.config import ModelConfig
from tspbench.core.layers import rope_tables


@dataclass
class TSPContext:
    comm: Comm  # the folded axis: D ranks
    cfg: ModelConfig
    seq_len: int
    cos: torch.Tensor  # RoPE tables of this rank's local tokens' *global* positions
    sin: torch.Tensor
    to_global: torch.Tensor  # gathered (rank-major) sequence order -> global order
    to_gathered: torch.Tensor  # global order -> gathered order

    @classmethod
    def build(
        cls, comm: Comm, cfg: ModelConfig, seq_len: int, dtype: torch.dtype, device: torch.device
    ) -> TSPContext:
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
