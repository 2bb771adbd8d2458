"""Context parallelism's per-sequence pieces, shared by SP, TP+SP and FSDP+CP: RoPE tables at the
zigzag tokens' global positions, and layer hooks that all-gather K/V along the sequence (reduce-
scatter in backward) and run zigzag causal attention, or (``cp_comm="a2a"``, SP and FSDP+CP:
DeepSpeed-Ulysses) re-shard Q, K/V and the output between sequence and heads with all-to-alls
and run causal attention over the whole sequence on H/D heads, or (``cp_comm="ring"``) pass
K/V chunks round the ring behind the attention (:mod:`tspbench.core.ring_attention`), or
(``cp_comm="a2a+p2p"``, Megatron-Core's hierarchical exchange) the all-to-all inside groups of
``cp_a2a`` consecutive ranks and the ring across the groups."""

from __future__ import annotations

import torch

from tspbench.core import zigzag
from tspbench.core.attention import attention
from tspbench.core.collectives import GatherSequence, HeadsToSeq, SeqToHeads
from tspbench.core.comm import Comm
from tspbench.core.config import ModelConfig
from tspbench.core.costs import Spec
from tspbench.core.exchange import check_exchange, inner_size, searched_exchange
from tspbench.core.layers import LayerHooks, cached, rope_tables
from tspbench.core.layout import Layout
from tspbench.core.mesh import Mesh
from tspbench.core.options import Value
from tspbench.core.ring_attention import ring_attention
from tspbench.core.strategy import Strategy


def zigzag_rope(
    seq_len: int, comm: Comm, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of this rank's zigzag tokens (global positions)."""
    pos = zigzag.positions(seq_len, comm.size, comm.rank)
    cos, sin = rope_tables(pos, cfg, dtype)
    return cos.to(device), sin.to(device)


class SequenceSharded(Strategy):
    """A strategy whose D ranks all split each sequence (SP, FSDP+CP, FSDP2+CP): its K/V
    exchange options checked over D, and searched by the planner, in one place."""

    @classmethod
    def context_parallel(cls, layout: Layout) -> int:
        return layout.degree

    @classmethod
    def validate(
        cls, cfg: ModelConfig, layout: Layout, seq_len: int, batch: int, **options: Value
    ) -> None:
        super().validate(cfg, layout, seq_len, batch)
        cp_comm, cp_a2a = options.get("cp_comm"), options.get("cp_a2a", 0)
        check_exchange(cfg, seq_len, layout.degree, cp_comm, cp_a2a=cp_a2a)

    @classmethod
    def searched_values(cls, spec: Spec | None) -> dict[str, tuple[Value, ...]]:
        out = super().searched_values(spec)
        return out if spec is None else searched_exchange(out, spec.cfg, spec.cp)


def exchange_groups(
    mesh: Mesh, axis: str, cfg: ModelConfig, cp_comm: str, cp_a2a: int, tp: int = 1
) -> tuple[Comm, Comm] | None:
    """a2a+p2p's (inner, outer) groups over the context-parallel ``axis``, made here
    (collectively: every rank builds its strategy at once); None for the other exchanges."""
    ranks = mesh.size(axis)
    if cp_comm != "a2a+p2p" or ranks == 1:
        return None
    return mesh.split(axis, inner_size(cfg, ranks, tp, cp_a2a))


def cp_tables(
    owner: object, seq_len: int, comm: Comm, cfg: ModelConfig, like: torch.Tensor,
    cp_comm: str = "all_gather", overlap: bool = True,
    groups: tuple[Comm, Comm] | None = None, **tp_hooks,
) -> tuple[torch.Tensor, torch.Tensor, LayerHooks]:  # fmt: skip
    """(cos, sin, hooks) of context parallelism over ``comm`` at ``seq_len`` for activations
    like ``like``: :func:`zigzag_rope` and the hooks of the exchange (``cp_comm``:
    :func:`context_parallel_hooks`, :func:`ulysses_hooks`, :func:`ring_hooks`, whose hops
    hide behind the attention unless ``overlap`` is off, or :func:`hierarchical_hooks` over
    ``groups`` (:func:`exchange_groups`); over one rank none, so no K/V copy),
    built once and kept with ``owner``
    (:func:`tspbench.core.layers.cached`)."""
    device = like.device
    kind = cp_comm if comm.size > 1 else None  # over one rank: no exchange
    key = ("cp", seq_len, like.dtype, device, id(comm), kind, overlap, *sorted(tp_hooks))

    def hooks() -> LayerHooks:
        if kind is None:  # K/V as projected, plain causal attention
            return LayerHooks(attn=attention, **tp_hooks)
        if kind == "ring":
            return ring_hooks(seq_len, comm, device, overlap, **tp_hooks)
        if kind == "a2a+p2p":
            if groups is None:
                raise ValueError("cp_comm=a2a+p2p needs its groups (exchange_groups)")
            return hierarchical_hooks(seq_len, comm, groups, device, overlap, **tp_hooks)
        make = ulysses_hooks if kind == "a2a" else context_parallel_hooks
        return make(seq_len, comm, device, **tp_hooks)

    return cached(owner, key, lambda: (
        *zigzag_rope(seq_len, comm, cfg, like.dtype, device), hooks(),
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


def ulysses_hooks(seq_len: int, comm: Comm, device: torch.device, **tp_hooks) -> LayerHooks:
    """DeepSpeed-Ulysses over ``comm``: Q and the packed K/V each re-sharded from this rank's
    zigzag tokens of every head to every token (global order) of H/D heads (one all-to-all
    each), causal attention over the whole sequence, the output back with one all-to-all;
    backward, the gradients the other way. Needs H and kv heads divisible by D
    (:func:`check_exchange`)."""
    to_g = zigzag.gathered_to_global(seq_len, comm.size).to(device)
    to_r = zigzag.global_to_gathered(seq_len, comm.size).to(device)

    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qh = SeqToHeads.apply(q, comm, to_g, to_r)
        kv = SeqToHeads.apply(torch.stack([k, v]), comm, to_g, to_r)
        return HeadsToSeq.apply(attention(qh, kv[0], kv[1]), comm, to_g, to_r)

    return LayerHooks(attn=attn, **tp_hooks)


def ring_hooks(
    seq_len: int, comm: Comm, device: torch.device, overlap: bool = True, **tp_hooks
) -> LayerHooks:
    """Ring attention over ``comm`` (Megatron-Core's ``p2p``): this rank's zigzag K/V chunks
    travel round the ring while each arriving chunk's attention runs (``overlap`` off: each hop
    waited for at once); the tokens stay local, so nothing is reordered."""
    return LayerHooks(attn=lambda q, k, v: ring_attention(q, k, v, comm, overlap), **tp_hooks)


def hierarchical_hooks(
    seq_len: int, comm: Comm, groups: tuple[Comm, Comm], device: torch.device,
    overlap: bool = True, **tp_hooks,
) -> LayerHooks:  # fmt: skip
    """Megatron-Core's ``a2a+p2p`` over ``comm``'s D ranks, as (inner, outer) ``groups`` of a
    and D/a ranks: Q and the packed K/V re-sharded by one all-to-all each inside the inner
    group, from its ranks' zigzag tokens of every head to all of them of H/a heads; ring
    attention of those heads across the groups; the output back by one all-to-all.

    The inner group g holds chunks ga..ga+a-1 and their mirrors 2D-1-ga-a+1..2D-1-ga: ordered
    as a zigzag over a ranks orders its gathered tokens, these are the chunks g and
    2(D/a)-1-g of a zigzag over the D/a groups with chunks a times as long, so the ring of
    :func:`ring_hooks` runs over the groups unchanged."""
    inner, outer = groups
    held = seq_len // comm.size * inner.size  # tokens of the inner group
    to_g = zigzag.gathered_to_global(held, inner.size).to(device)
    to_r = zigzag.global_to_gathered(held, inner.size).to(device)

    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qh = SeqToHeads.apply(q, inner, to_g, to_r)
        kv = SeqToHeads.apply(torch.stack([k, v]), inner, to_g, to_r)
        o = ring_attention(qh, kv[0], kv[1], outer, overlap)
        return HeadsToSeq.apply(o, inner, to_g, to_r)

    return LayerHooks(attn=attn, **tp_hooks)
