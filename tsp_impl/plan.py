"""What every TSP schedule needs to know about its rank: the group, the shapes, the zigzag.

Everything position-dependent is built once per sequence length (the plan is cached by the
model) and reused by every layer, head group and step: the RoPE rotation tables of the local
tokens' global positions, the zigzag chunks' query and key ranges, and the index vectors that put
gathered K/V in global order and scatter-add their gradients back in gathered order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tspbench.core import zigzag
from tspbench.core.comm import Comm
from tspbench.core.config import ModelConfig
from tspbench.core.layers import rope_tables


def rotation_table(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half layout) as a 2x2 rotation of each pair (x_i, x_{i+d/2}):
    [L, 1, 2, 2, d/2], entry [l, 0, i, k] the coefficient of half k in output half i. Its
    transpose in (i, k) rotates by -theta: the VJP."""
    half = cos.shape[-1] // 2
    c, s = cos[:, :half], sin[:, :half]
    return torch.stack([torch.stack([c, -s], dim=1), torch.stack([s, c], dim=1)], dim=1)[:, None]


@dataclass
class TSPPlan:
    comm: Comm  # the folded axis: D ranks
    cfg: ModelConfig
    seq_len: int
    rot: torch.Tensor  # RoPE at the local tokens' *global* positions [S/D, 1, 2, 2, d/2]
    to_global: torch.Tensor  # gathered (rank-major) sequence order -> global order
    dkv_index: torch.Tensor  # rows of the chunks' [dK; dV] -> rows of [S, 2] in gathered order
    overlap: bool = True  # prefetch the next shard while computing on this one
    kv_bucket: int = 0  # KV heads per attention bucket (0: the whole head group at once)
    save_kv: bool = False  # keep the gathered K/V for backward instead of gathering them again
    ring: bool = False  # pass K/V chunks round the ring instead of all-gathering them

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
        save_kv: bool = False,
        ring: bool = False,
    ) -> TSPPlan:
        D, r = comm.size, comm.rank
        cos, sin = rope_tables(zigzag.positions(seq_len, D, r), cfg, dtype)
        to_global = zigzag.gathered_to_global(seq_len, D)
        # rows of the chunks' dK, dV at their keys' gathered positions g: K at 2g, V at 2g+1, in
        # the order [dK, dV of every chunk but the last; dK of the last] then [dV of the last]
        keys = [2 * to_global[:n] for _, _, n in chunk_ranges(seq_len, D, r)]
        rows = [x for k in keys[:-1] for x in (k, k + 1)] + [keys[-1], keys[-1] + 1]
        dkv_index = torch.cat(rows)
        return cls(
            comm,
            cfg,
            seq_len,
            rotation_table(cos, sin).to(device),
            to_global.to(device, torch.int32),  # (int32: half the bytes of the default int64)
            dkv_index.to(device, torch.int32),
            overlap,
            kv_bucket,
            save_kv,
            ring and D > 1,  # (one rank: plain attention either way)
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

    @property
    def rot_inv(self) -> torch.Tensor:
        """The inverse rotations (a view): what the backward applies to dQ and dK."""
        return self.rot.transpose(2, 3)

    @property
    def chunks(self) -> list[tuple[int, int, int]]:
        """(first, end) local query rows and the key count of each causal attention call."""
        return chunk_ranges(self.seq_len, self.D, self.rank)

    def buckets(self) -> list[tuple[slice, slice]]:
        """(query-head slice, kv-head slice) of each attention bucket of a head group.

        A bucket of b KV heads bounds the gathered K/V buffer to 2*B*b*S*d elements, at the price
        of hkv/b all-gathers per head group instead of one (same bytes, more latency).
        """
        b = self.kv_bucket or self.hkv
        g = self.hq // self.hkv  # query heads per KV head (GQA)
        return [(slice(i * g, (i + b) * g), slice(i, i + b)) for i in range(0, self.hkv, b)]


def bucket_count(hkv: int, kv_bucket: int) -> int:
    """Attention buckets per head group of ``hkv`` KV heads (:meth:`TSPPlan.buckets`'s count,
    which the closed forms charge)."""
    return hkv // (kv_bucket or hkv)


def chunk_ranges(seq_len: int, D: int, rank: int) -> list[tuple[int, int, int]]:
    """Local chunk j (global chunk r or 2D-1-r) is one lower-right causal call over the first
    (j+1) S/2D keys; with D = 1 the whole sequence is one call."""
    if D == 1:
        return [(0, seq_len, seq_len)]
    c = seq_len // (2 * D)
    return [(i * c, (i + 1) * c, (j + 1) * c) for i, j in enumerate(zigzag.chunk_ids(rank, D))]
