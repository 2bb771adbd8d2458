"""The KV cache and the split-K attention of one decode step (``docs/decode.md``).

A rank's cache holds, per layer, K (after RoPE) and V of the tokens it keeps, for the KV heads it
keeps: ``[B, heads, capacity, d]``, allocated once at prefill. A cache split by sequence over
``ranks`` ranks takes the token at position ``pos`` on rank ``pos mod ranks`` (round-robin), so
the slices stay balanced as it grows. Decode attention needs no mask (the new query sees every
cached key), so each slice's partial output and log-sum-exp merge exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tspbench.core.comm import Comm
from tspbench.core.config import ConfigError


@dataclass
class Step:
    """One generation step's result on this rank: the greedy next tokens [B] (the same on every
    rank) and this rank's logits [B, V_local] (fp32), columns [offset, offset + V_local) of the
    vocabulary; ``comm`` splits the vocabulary (None: the logits are whole)."""

    tokens: torch.Tensor
    logits: torch.Tensor
    comm: Comm | None = None

    def full_logits(self) -> torch.Tensor:
        """Whole logits [B, V] (collective where the vocabulary is split; for checks only)."""
        if self.comm is None or self.comm.size == 1:
            return self.logits
        return self.comm.all_gather(self.logits, dim=1)


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer [B, heads, capacity, d]
    v: list[torch.Tensor]
    length: int = 0  # tokens this rank holds
    pos: int = 0  # tokens of the sequence so far: the position of the next one
    ranks: int = 1  # ranks that split the sequence
    rank: int = 0

    @classmethod
    def empty(
        cls,
        layers: int,
        batch: int,
        heads: int,
        capacity: int,
        head_dim: int,
        like: torch.Tensor,
        ranks: int = 1,
        rank: int = 0,
    ) -> KVCache:
        """A cache of ``capacity`` token slots per layer, dtype and device of ``like``."""

        def new() -> torch.Tensor:
            return like.new_zeros((batch, heads, capacity, head_dim))

        return cls(
            [new() for _ in range(layers)], [new() for _ in range(layers)], 0, 0, ranks, rank
        )

    @staticmethod
    def capacity(prompt_len: int, max_len: int, ranks: int) -> int:
        """Token slots one rank needs: its share of the prompt, and of the tokens appended
        round-robin up to ``max_len`` (the most any rank receives)."""
        return prompt_len // ranks + -(-(max_len - prompt_len) // ranks)

    def fill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Prefill: this rank's prompt tokens' K/V [B, heads, n, d] into slots [0, n)."""
        n = k.shape[2]
        self._room(n)
        self.k[layer][:, :, :n] = k
        self.v[layer][:, :, :n] = v

    def start(self, prompt_tokens: int, prompt_len: int) -> None:
        """After prefill: this rank holds ``prompt_tokens`` of a ``prompt_len``-token prompt."""
        self.length, self.pos = prompt_tokens, prompt_len

    @property
    def mine(self) -> bool:
        """Whether this rank appends the next token (round-robin: position mod ranks)."""
        return self.pos % self.ranks == self.rank

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The next token's K/V [B, heads, d] into slot ``length`` (call only if :attr:`mine`)."""
        self._room(self.length + 1)
        self.k[layer][:, :, self.length] = k
        self.v[layer][:, :, self.length] = v

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the tokens this rank holds in this step (the next one included if mine)."""
        n = self.length + int(self.mine)
        return self.k[layer][:, :, :n], self.v[layer][:, :, :n]

    def advance(self) -> None:
        """After every layer of a step: the token is in (on its owner), the sequence one longer."""
        self.length += int(self.mine)
        self.pos += 1

    def _room(self, n: int) -> None:
        cap = self.k[0].shape[2] if self.k else 0
        if n > cap:
            raise ConfigError(f"kv cache: {n} tokens on rank {self.rank}, allocated for {cap}")

    def nbytes(self) -> int:
        """Bytes allocated for K and V (every slot, used or not)."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def tensors(self) -> list[torch.Tensor]:
        return [*self.k, *self.v]


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, Hq, d] fp32, normalised over these keys; lse [B, Hq] fp32) of one query per
    sequence, q [B, Hq, d], over keys k, v [B, Hkv, n, d] (GQA: Hq a multiple of Hkv). No mask:
    a decode query sees every cached key. n = 0 gives o = 0, lse = -inf (merges as nothing).

    Scores and P V run in the cache's dtype, softmax in fp32 (as flash-decoding does)."""
    B, Hq, d = q.shape
    Hkv, n = k.shape[1], k.shape[2]
    g = Hq // Hkv
    qg = q.view(B, Hkv, g, d)
    s = torch.matmul(qg, k.transpose(-1, -2)).float() * d**-0.5  # [B, Hkv, g, n]
    lse = torch.logsumexp(s, dim=-1)
    p = (s - lse[..., None]).exp() if n else s
    o = torch.matmul(p.to(v.dtype), v).float()  # [B, Hkv, g, d]
    return o.reshape(B, Hq, d), lse.reshape(B, Hq)


def _weighted(o: torch.Tensor, lse: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[w o, w] packed [B, H, d + 1] fp32, w = exp(lse - max over the group's lse)."""
    m = lse.clone()
    if comm.size > 1:
        comm.all_reduce(m, op=dist.ReduceOp.MAX)
    w = (lse - m).exp()
    return torch.cat([o * w[..., None], w[..., None]], dim=-1)


def merge_all(o: torch.Tensor, lse: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Exact attention output [B, H, d] (fp32) on every rank, from every rank's partial one over
    its slice of the keys: an all-reduce (max) of lse, then an all-reduce (sum) of [w o, w]."""
    if comm.size == 1:
        return o
    packed = comm.all_reduce(_weighted(o, lse, comm))
    return packed[..., :-1] / packed[..., -1:]


def merge_scatter(o: torch.Tensor, lse: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Exact attention output of this rank's block of heads [B, H/D, d] (fp32): as
    :func:`merge_all`, with the sum reduce-scattered over heads (block r to rank r)."""
    if comm.size == 1:
        return o
    packed = comm.reduce_scatter(_weighted(o, lse, comm), dim=1)
    return packed[..., :-1] / packed[..., -1:]
