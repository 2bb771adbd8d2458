"""Closed-form pieces of a step's cost that several strategies share.

Every strategy states the cost of its step per rank through its costs object, a :class:`Costs`
(``param_numel``, ``schedule``, ``saved_per_layer``, ...): the analytic model
(:mod:`tspbench.projection.analytic`) and the cost model ask it and never switch on a
strategy's name. This module holds that interface and what the answers share: the event of a
communication schedule (docs/method.md section 6), parameter counts, and the formulas of the
plain autograd layer and loss (:func:`tspbench.core.layers.transformer_layer`, torch's
cross-entropy or the vocabulary-parallel one) that the baselines run, with their GEMM weights
split T ways (Megatron tensor parallelism; T = 1: whole weights) and their sequences split
into zigzag chunks over the context-parallel ranks (docs/method.md section 7 for the memory).
TSP's own formulas are in ``tsp_impl/costs.py``.

Notation (docs/method.md section 1): B micro-batch, S sequence, h hidden, kv = n_kv*d, f MLP size,
V vocabulary, L layers, e bytes per element; t = tokens on this rank, T the weight split, P the
context-parallel degree.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, Protocol

from tspbench.core.config import ModelConfig
from tspbench.core.exchange import inner_size
from tspbench.core.layout import Layout

FP32 = 4
INT64 = 8  # counts (the experts' rows per expert)


class Event(tuple):
    """One collective of a schedule: ``(phase, axis, kind, group size, full tensor bytes)``, as it
    unpacks, and ``overlapped``: whether the implementation hides it behind compute (issued
    asynchronously ahead of, or drained behind, work that does not wait for it: a prefetched
    weight, a reduction finished one step later). The cost model hides exactly the overlapped
    events (docs/projection.md). The flag rides beside the five fields (code that unpacks five
    keeps working) and takes no part in comparisons. ``per_step``: issued once per step however
    many micro-batches a pipeline runs (a gradient reduction of ``finish_grads``; FSDP+CP's kept
    units' gathers, in the first micro-batch)."""

    overlapped: bool
    per_step: bool

    def __new__(
        cls,
        phase: str,
        axis: str,
        kind: str,
        size: int,
        nbytes: float,
        overlapped: bool = False,
        per_step: bool = False,
    ) -> Event:
        ev = super().__new__(cls, (phase, axis, kind, size, float(nbytes)))
        ev.overlapped, ev.per_step = overlapped, per_step
        return ev


class Spec(Protocol):
    """What the closed forms read of one run (read only): :class:`tspbench.runtime.spec.RunSpec`,
    duck-typed here, so that the core and the strategies need not import the runtime."""

    @property
    def cfg(self) -> ModelConfig: ...
    @property
    def layout(self) -> Layout: ...
    @property
    def seq_len(self) -> int: ...
    @property
    def batch(self) -> int: ...
    @property
    def degree(self) -> int: ...  # D
    @property
    def tp(self) -> int: ...  # T of tpsp
    @property
    def sp(self) -> int: ...  # Sigma of tpsp
    @property
    def dp(self) -> int: ...  # data-parallel replicas
    @property
    def e(self) -> int: ...  # bytes per element of the compute dtype
    @property
    def train(self) -> bool: ...
    @property
    def rc(self) -> bool: ...  # activation recomputation in effect
    @property
    def cp(self) -> int: ...  # P: ranks that split a sequence
    @property
    def tokens(self) -> int: ...  # t
    @property  # the strategy's own options (tspbench/core/options.py)
    def options(self) -> Mapping[str, Any]: ...
    @property  # one stage's work of a pipeline of this many stages (0: a whole model)
    def stage_of(self) -> int: ...


class Schedule(list[Event]):
    """The collectives one rank issues in a step, in the order it issues them."""

    def add(
        self,
        phase: str,
        axis: str,
        kind: str,
        size: int,
        nbytes: float,
        times: int = 1,
        overlapped: bool = False,
        exposed: int = 0,
        per_step: bool = False,
    ) -> None:
        """``times`` events; ``overlapped``: the implementation hides them behind compute, all
        but ``exposed`` of them (a prefetch loop's first transfer and a drain's last have nothing
        to hide behind: they are waited for at once); ``per_step``: :class:`Event`'s."""
        hidden = max(times - exposed, 0) if overlapped else 0
        self.extend([Event(phase, axis, kind, size, nbytes, False, per_step)] * (times - hidden))
        self.extend([Event(phase, axis, kind, size, nbytes, True, per_step)] * hidden)


def phases(c: Spec) -> tuple[str, ...]:
    """The passes of a step: forward, and backward when training."""
    return ("forward", "backward") if c.train else ("forward",)


# -- parameters -------------------------------------------------------------------------------
def qk_norm_numel(cfg: ModelConfig) -> int:
    """Elements of one layer's QK norms (Qwen3: [d] each), else 0."""
    return 2 * cfg.d_head if cfg.qk_norm else 0


def output_bias_numel(cfg: ModelConfig) -> int:
    """Elements of one layer's output biases (Llama's bo and b2: [h] each where it has them),
    added after a tensor-parallel reduction: whole on every rank."""
    return cfg.hidden * (cfg.o_bias + cfg.mlp_bias)


def layer_numel(cfg: ModelConfig) -> int:
    """Elements of one transformer layer: two norms (four with QK norms), Wq/Wo, Wk/Wv,
    W1/W3/W2 (and the biases); with experts the MoE MLP's (:func:`moe_mlp_numel`) instead."""
    h, q, kv, f = cfg.hidden, cfg.q_dim, cfg.kv_dim, cfg.ffn
    biases = q + 2 * kv if cfg.qkv_bias else 0  # Qwen2's, split with their weights
    biases += 2 * f if cfg.mlp_bias else 0  # b1, b3: split with W1's and W3's rows
    return (
        2 * h
        + 2 * h * q
        + 2 * h * kv
        + (3 * h * f if not cfg.moe else moe_mlp_numel(cfg))
        + qk_norm_numel(cfg)
        + biases
        + (output_bias_numel(cfg))
    )


# -- a mixture of experts ----------------------------------------------------------------------
def expert_numel(cfg: ModelConfig) -> int:
    """Elements of one layer's routed experts: E x [W1_e; W3_e; W2_e] (0 without experts)."""
    return cfg.experts * 3 * cfg.moe_ffn * cfg.hidden


def gate_numel(cfg: ModelConfig) -> int:
    """Elements of one layer's router [E, h] and a shared expert's gate [1, h]: whole on every
    rank of TSP and TP (FSDP+CP shards them in its layer's unit); 0 without experts."""
    return (cfg.experts + bool(cfg.shared_ffn)) * cfg.hidden if cfg.moe else 0


def moe_mlp_numel(cfg: ModelConfig) -> int:
    """Elements of one layer's MoE MLP: router, experts, a shared expert and its gate."""
    return gate_numel(cfg) + expert_numel(cfg) + 3 * cfg.shared_ffn * cfg.hidden


def dispatch_combine(c: Spec, ev: Schedule, axis: str, size: int) -> None:
    """Expert parallelism's exchanges over ``size`` ranks (tspbench/core/expert_parallel.py),
    every layer: the per-expert counts (one even all-to-all of E int64), then each local
    token's k rows to their experts' owners and back; backward the rows' gradients both ways
    (a recomputed layer exchanges again). The rows that leave a rank depend on the routing:
    under even routing (each expert as busy as the others; exact with k = E) (size-1)/size of
    them, the counter's share of a full all-to-all's bytes."""
    cfg, L = c.cfg, c.cfg.layers
    rows = c.tokens * cfg.top_k * cfg.hidden * c.e
    for phase in phases(c):
        n = L if phase == "forward" or c.rc else 0
        ev.add(phase, axis, "all_to_all", size, cfg.experts * INT64, n)
        ev.add(phase, axis, "all_to_all", size, rows, 2 * n)
        if phase == "backward":
            ev.add(phase, axis, "all_to_all", size, rows, 2 * L)


def routing_counts(c: Spec, ev: Schedule, axis: str, size: int) -> None:
    """The load-balancing loss's per-expert counts summed over ``axis``, whose ranks hold
    different tokens (``Strategy.routing_done``: the model group's where it splits them, the
    replicas'), once per forward; nothing without experts or the loss."""
    if c.cfg.moe and c.cfg.aux_loss:
        ev.add("forward", axis, "all_reduce", size, c.cfg.experts * INT64)


def replicated_numel(cfg: ModelConfig) -> int:
    """Elements never split: the RMSNorm weights (two per layer, their QK norms, and the final
    one), the output biases, and with experts the routers and shared gates."""
    per_layer = qk_norm_numel(cfg) + output_bias_numel(cfg) + gate_numel(cfg)
    return (2 * cfg.layers + 1) * cfg.hidden + cfg.layers * per_layer


def full_numel(cfg: ModelConfig) -> int:
    """Elements of the whole model (the LM head counted once more unless tied)."""
    tables = 1 if cfg.tie_embeddings else 2  # the embedding, and an untied head
    return cfg.layers * layer_numel(cfg) + tables * cfg.vocab * cfg.hidden + cfg.hidden


def split_numel(cfg: ModelConfig, T: int) -> int:
    """Elements one rank holds when every weight but the norms and output biases is split T
    ways."""
    return (full_numel(cfg) - replicated_numel(cfg)) // T + replicated_numel(cfg)


def local_dims(cfg: ModelConfig, T: int) -> tuple[int, int, int, int]:
    """(query heads, kv width, MLP width, vocabulary rows) of the weights one rank applies."""
    return cfg.heads // T, cfg.kv_dim // T, cfg.ffn // T, cfg.vocab // T


# -- communication ----------------------------------------------------------------------------
def kv_bytes(c: Spec, T: int = 1) -> int:
    """One layer's K and V over the whole sequence, of the kv heads a rank applies."""
    return 2 * c.batch * c.seq_len * c.cfg.kv_dim // T * c.e


def kv_gather(ev: Schedule, c: Spec, phase: str, axis: str, size: int, nbytes: int) -> None:
    """Context parallelism in one phase: every layer's K/V all-gathered along the sequence (in
    forward, and again in a recomputed forward), their gradients reduce-scattered in backward."""
    L = c.cfg.layers
    ev.add(phase, axis, "all_gather", size, nbytes, L if phase == "forward" or c.rc else 0)
    if phase == "backward":
        ev.add(phase, axis, "reduce_scatter", size, nbytes, L)


def cp_comm(c: Spec) -> str:
    """How the run's context parallelism exchanges (SP, FSDP+CP's ``cp_comm``): all_gather
    (the K/V gathers; also with no context parallelism), a2a (DeepSpeed-Ulysses) or ring."""
    return c.options.get("cp_comm", "all_gather") if c.cp > 1 else "all_gather"


def ulysses(c: Spec) -> bool:
    """Whether the run's context parallelism exchanges by all-to-all (``cp_comm=a2a``)."""
    return cp_comm(c) == "a2a"


def ring(c: Spec) -> bool:
    """Whether the run's context parallelism passes K/V round a ring (``cp_comm=ring``)."""
    return cp_comm(c) == "ring"


def hierarchical(c: Spec) -> bool:
    """Whether the run's context parallelism is Megatron-Core's ``a2a+p2p``."""
    return cp_comm(c) == "a2a+p2p"


def cp_inner(c: Spec, T: int = 1) -> int:
    """a2a+p2p's inner all-to-all group (``cp_a2a``, or the largest that fits)."""
    return inner_size(c.cfg, c.cp, T, int(c.options.get("cp_a2a", 0)))


def ring_p2p(ev: Schedule, c: Spec, phase: str, axis: str, size: int, T: int = 1) -> None:
    """Ring attention in one phase (:mod:`tspbench.core.ring_attention`), per layer: forward
    (and a recomputed forward), D-1 hops of this rank's packed K/V (of its kv heads: 1/T of
    them under tensor parallelism), each sent on before the block it arrived for is computed
    (all hidden); backward, D-1 hops of K/V again and D of the fp32 dK/dV sums, each issued
    before a block's compute but the last, which is waited for at once (``overlap`` off: every
    hop is)."""
    L, kv = c.cfg.layers, 2 * c.tokens * c.cfg.kv_dim // T
    n, hide = (L if phase == "forward" or c.rc else 0), c.options.get("overlap", True)
    ev.add(phase, axis, "send_recv", size, kv * c.e, n * (size - 1), overlapped=hide)
    if phase == "backward":
        ev.add(phase, axis, "send_recv", size, kv * c.e, L * (size - 1), overlapped=hide)
        ev.add(phase, axis, "send_recv", size, kv * FP32, L * (size - 1), overlapped=hide)
        ev.add(phase, axis, "send_recv", size, kv * FP32, L)


def ulysses_a2a(ev: Schedule, c: Spec, phase: str, axis: str, size: int, T: int = 1) -> None:
    """Ulysses in one phase, per layer: Q, the packed K/V and the output (of this rank's heads:
    1/T of them under tensor parallelism) each re-sharded by one all-to-all of this rank's
    [t, ...] block (in forward, and again in a recomputed forward); backward, the output's
    gradient, then K/V's and Q's, the other way."""
    L, t, e = c.cfg.layers, c.tokens, c.e
    q, kv = t * c.cfg.q_dim // T * e, 2 * t * c.cfg.kv_dim // T * e
    n = L if phase == "forward" or c.rc else 0
    for nbytes in (q, kv, q):  # q, k/v, out
        ev.add(phase, axis, "all_to_all", size, nbytes, n)
    if phase == "backward":
        for nbytes in (q, kv, q):  # d out, d k/v, d q
            ev.add(phase, axis, "all_to_all", size, nbytes, L)


def context_parallel(c: Spec, axis: str, size: int) -> Schedule:
    """The K/V gathers of context parallelism over ``size`` ranks (SP, FSDP+CP), whole heads;
    or, with ``cp_comm=a2a``, the Ulysses all-to-alls; with ``cp_comm=ring``, the ring's hops;
    with ``a2a+p2p``, both, on the axis's inner and outer groups (``<axis>.a2a``, ``.p2p``)."""
    ev = Schedule()
    for phase in phases(c):
        cp_exchange(ev, c, phase, axis, size)
    return ev


def cp_exchange(ev: Schedule, c: Spec, phase: str, axis: str, size: int, T: int = 1) -> None:
    """Context parallelism's exchange over ``size`` ranks in one phase, of the heads a rank
    applies (1/T of them under tensor parallelism): the run's ``cp_comm``."""
    if ulysses(c):
        ulysses_a2a(ev, c, phase, axis, size, T)
    elif hierarchical(c):  # the inner groups' all-to-alls, then the ring across them of as
        # many K/V bytes per rank (a times the tokens of 1/a of the heads)
        a = cp_inner(c, T)
        ulysses_a2a(ev, c, phase, f"{axis}.a2a", a, T)
        ring_p2p(ev, c, phase, f"{axis}.p2p", size // a, T)
    elif ring(c):
        ring_p2p(ev, c, phase, axis, size, T)
    else:
        kv_gather(ev, c, phase, axis, size, kv_bytes(c, T))


def grads_all_reduce(ev: Schedule, c: Spec, axis: str, size: int, numel: int) -> None:
    """Training: every gradient (``numel`` elements) summed in one packed all-reduce."""
    if c.train:
        ev.add("backward", axis, "all_reduce", size, numel * c.e, per_step=True)


def megatron(
    c: Spec, T: int, axis: str, cp_axis: str | None = None, cp: int = 1, loss: bool = True
) -> Schedule:
    """Megatron tensor parallelism over the T ranks of ``axis`` (TP; TP+SP, whose local heads
    are also exchanged over the ``cp`` ranks of ``cp_axis`` in every phase, by its
    ``cp_comm``); ``loss`` off: the forward pass without the vocabulary-parallel loss (a
    decoder's prefill, which picks one next token instead)."""
    L, act = c.cfg.layers, c.tokens * c.cfg.hidden * c.e  # one [t, h] activation
    ev = Schedule()
    ev.add("forward", axis, "all_reduce", T, act)  # embedding
    for phase in phases(c):
        # forward: two row-parallel all-reduces per layer; backward: two copy_to all-reduces,
        # plus the recomputed forward, which stops after the last op that saves a tensor
        # (the W2 GEMM): so its last all-reduce is not repeated
        n = 2 * L if phase == "forward" else 2 * L + (L if c.rc else 0)
        ev.add(phase, axis, "all_reduce", T, act, n)
        if cp_axis is not None:
            cp_exchange(ev, c, phase, cp_axis, cp, T)
    if loss:
        ev.add("forward", axis, "all_reduce", T, c.tokens * FP32, 3)  # CE max, sum-exp, target
    if c.train:
        ev.add("backward", axis, "all_reduce", T, act)  # copy_to before the LM head
        # QK norms: each rank's gradient sums over its heads only (Megatron-Core all-reduces
        # them over TP as well)
        # with experts the routers and shared gates too (each rank's covers its experts)
        n = c.cfg.layers * (qk_norm_numel(c.cfg) + gate_numel(c.cfg)) * c.e
        if n:
            ev.add("backward", axis, "all_reduce", T, n, per_step=True)
    return ev


# -- memory of the plain autograd layer and loss ----------------------------------------------
def kv_unit(c: Spec, kvl: int) -> int:
    """One gathered K/V pair (context parallel: the whole sequence), or the local one."""
    return 2 * (c.batch * c.seq_len if c.cp > 1 else c.tokens) * kvl * c.e


def norms_saved(c: Spec) -> int:
    """Bytes a layer's two RMSNorms keep for backward and the two normed inputs the projections
    keep: per RMSNorm its input (compute dtype) and the fp32 1/rms; the weight is a parameter."""
    t, h = c.tokens, c.cfg.hidden
    return 2 * (t * h * c.e + 4 * t) + 2 * t * h * c.e


def final_norm_saved(c: Spec) -> int:
    """Bytes the final RMSNorm keeps for backward, and its output."""
    t, h = c.tokens, c.cfg.hidden
    return t * h * c.e + 4 * t + t * h * c.e


def route_saved(c: Spec) -> int:
    """Bytes a router keeps for backward over this rank's t tokens (tspbench/core/moe.py): its
    fp32 probabilities [t, E] (softmax's output), the chosen experts [t, k] (int64) and, where
    the family renormalises, the fp32 top-k weights and their sum."""
    cfg, t = c.cfg, c.tokens
    k = cfg.top_k
    return FP32 * t * cfg.experts + INT64 * t * k + (FP32 * t * (k + 1) if cfg.norm_topk else 0)


def routed_saved(c: Spec, rows: int, how: str) -> int:
    """Bytes the routed experts keep for backward over their ``rows`` (token, slot) rows on
    this rank under even routing, by how tokens meet experts (``how``):
    - ``local``: plain autograd on this rank's tokens (core/moe.py ``routed_experts``): per row
      its token and slot (int64), its input, the SwiGLU's four [f_e] tensors, the expert's
      output, the weighted output and its weight;
    - ``dispatch``: the all-to-all dispatcher (core/expert_parallel.py): per row four int64
      orders (dispatch, token, by expert, the received rows'), the rows sent, received and
      by expert, the four [f_e] tensors, the combined output and its weight;
    - ``moving``: TSP's experts brought to the tokens (tsp_impl/moe.py ``MovingExperts``):
      per row [h1 h3] and the unweighted output, and the tokens' [t, k] weights.
    (Per-layer saved bytes equal the fake-tensor estimate's to the byte.)"""
    cfg, e = c.cfg, c.e
    h, fe = cfg.hidden, cfg.moe_ffn
    if how == "moving":
        return rows * (2 * fe + h) * e + c.tokens * cfg.top_k * e
    if how == "local":
        return rows * (2 * INT64 + (3 * h + 4 * fe + 1) * e)
    return rows * (4 * INT64 + (4 * h + 4 * fe + 1) * e)


def shared_saved(c: Spec, dense_mlp: int) -> int:
    """Bytes a shared expert keeps for backward (Qwen2-MoE's; 0 without): its MLP's saved
    tensors (``dense_mlp``, the strategy's own for a [t, f_s/T] MLP), its output and the
    sigmoid of its gate, which scales it."""
    if not c.cfg.shared_ffn:
        return 0
    return dense_mlp + c.tokens * (c.cfg.hidden + 1) * c.e


def moe_saved(c: Spec, T: int, how: str) -> int:
    """Bytes a plain MoE MLP (its experts split T ways with their rows, as TP's; ``how``:
    :func:`routed_saved`'s) keeps for backward: the router's, the routed experts' over the
    t k / T rows even routing gives this rank, a shared expert's."""
    t, e = c.tokens, c.e
    shared = shared_saved(c, 4 * t * (c.cfg.shared_ffn // T) * e)
    return route_saved(c) + routed_saved(c, t * c.cfg.top_k // T, how) + shared


def expert_rows(c: Spec, T: int, how: str) -> tuple[int, int]:
    """(rows this rank computes, rows one expert computes at a time) under even routing, E
    dividing t k (else a few rows more on the first experts' rank: ``moe.even_counts``): t k / T
    rows over this rank's E / T experts (``local``: its tokens', or TP's, every token's), t k
    over its E / D experts (``dispatch``: every rank's rows for them), t k of its own tokens
    over all E experts, one at a time (``moving``: the experts come to the tokens)."""
    cfg, t = c.cfg, c.tokens
    rows = t * cfg.top_k // (T if how == "local" else 1)
    held = {"local": cfg.experts // T, "dispatch": cfg.experts // c.degree}.get(how, cfg.experts)
    return rows, rows // held


def moe_working_set(c: Spec, T: int, how: str, shared: bool = True) -> int:
    """A forward-only MoE MLP's crest beyond the layer's input, the residual sum and its normed
    copy: the router's logits and fp32 probabilities (a small term, kept though they die with
    ``route``), and one expert's SwiGLU on its rows (three [f_e] tensors, four where [h1 h3]
    is one GEMM's output: moving experts) beside the output being summed and the expert's
    input rows (``local``, ``moving``; plain autograd crests instead where the summed output
    is copied: two of it, the weighted rows), or beside the received rows and their copy by
    expert (``dispatch``; its combine crests with five row-sized buffers and two outputs);
    a shared expert's MLP (three [t, f_s/T] tensors) beside the routed output instead where
    larger (``shared`` off: the caller prices it). Fitted to the fake-tensor peaks."""
    cfg, e, t = c.cfg, c.e, c.tokens
    h, fe = cfg.hidden, cfg.moe_ffn
    rows, n = expert_rows(c, T, how)
    act = t * h * e
    router = t * cfg.experts * (e + FP32)
    routed = (
        router
        + {
            "local": max(act + n * (h + 3 * fe) * e, 2 * act + n * (2 * h + 1) * e),
            "dispatch": max(3 * rows * h * e + 3 * n * fe * e, 5 * rows * h * e + 2 * act),
            "moving": act + n * (h + 4 * fe) * e,
        }[how]
    )
    if cfg.shared_ffn and shared:
        routed = max(routed, act + 3 * t * (cfg.shared_ffn // T) * e)
    return routed


def dense_shared(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with its shared expert as the dense MLP: a strategy that runs the shared expert
    as its MLP prices it by its dense closed forms."""
    return dataclasses.replace(
        cfg, ffn=cfg.shared_ffn, experts=0, top_k=0, expert_ffn=0, shared_ffn=0, aux_loss=0.0,
        norm_topk=True,
    )  # fmt: skip


def moe_backward_t(c: Spec, T: int, how: str, blocks: int = 0) -> int:
    """A MoE MLP's backward crest beyond its saved tensors and the layer's residual gradient:
    the gradient of the normed input being summed, and one expert's (its output's gradient and
    two of its SwiGLU's [f_e] gradients); dispatched rows: two more of the rows' gradients
    (combined, by expert); experts brought to the tokens: the weights' gradient and ``blocks``
    bytes of packed experts and their gradients in flight."""
    cfg, e, t = c.cfg, c.e, c.tokens
    h, fe = cfg.hidden, cfg.moe_ffn
    rows, n = expert_rows(c, T, how)
    # (moving experts: TSP's SiLU backward by hand, five [f_e] buffers, as its MLP slices')
    one = n * ((2 * h + 5 * fe) if how == "moving" else (h + 2 * fe)) * e
    extra = {"dispatch": 2 * rows * h * e, "moving": t * cfg.top_k * e + blocks}.get(how, 0)
    return t * h * e + one + extra


def mlp_saved(c: Spec, T: int, experts: str) -> int:
    """Bytes a plain layer's MLP keeps for backward: h1, silu(h1), h3 and their product, [t,
    f/T] each; a MoE MLP's by how its tokens meet the experts (:func:`moe_saved`)."""
    return moe_saved(c, T, experts) if c.cfg.moe else 4 * c.tokens * (c.cfg.ffn // T) * c.e


def saved_per_layer(c: Spec, T: int, experts: str = "local") -> int:
    """Bytes one plain layer keeps for backward (no recomputation), from what each op saves;
    a MoE MLP's by how its tokens meet the experts (``experts``: :func:`routed_saved`)."""
    cfg, e, t, B, S = c.cfg, c.e, c.tokens, c.batch, c.seq_len
    nh, kvl, fl, _ = local_dims(cfg, T)
    # the gathered K/V, or local K/V (Ulysses: every token of H/D heads, as many bytes; ring:
    # this rank's packed K/V, which backward sends round again)
    kv = 2 * B * S * kvl * e if c.cp > 1 and cp_comm(c) == "all_gather" else 2 * t * kvl * e
    # zigzag chunks are concatenated, so merging heads copies; Ulysses: the attention keeps its
    # output (H/D heads, every token) and the W_o GEMM the all-to-all's, as many bytes; the
    # ring merges in place into its first block's output, laid out as the kernel's (merging
    # heads is a view)
    o_copy = c.cp > 1 and not ring(c)
    attn = (2 + o_copy) * t * nh * cfg.d_head * e + 4 * t * nh + kv
    if cfg.qk_norm:  # each QK norm keeps its input (the projection) and its fp32 1/rms
        attn += t * (nh * cfg.d_head + kvl) * e + 4 * t * (nh + kvl // cfg.d_head)
    return norms_saved(c) + attn + mlp_saved(c, T, experts)


def saved_loss(c: Spec, T: int, vocab_parallel: bool) -> int:
    """Bytes the final norm and the loss keep for backward."""
    t, vl = c.tokens, c.cfg.vocab // T
    if vocab_parallel:
        return final_norm_saved(c) + 4 * t * vl + 13 * t  # exp(logits - max), sum, hit, index
    return final_norm_saved(c) + 4 * t * vl  # log-softmax output


def inference_working_set(
    c: Spec, T: int, vocab_parallel: bool, experts: str = "local"
) -> tuple[int, int]:
    """(layer, loss) working sets of a forward-only step. A plain layer's attention and MLP are
    functions of their own (:func:`tspbench.core.layers.transformer_layer`), so the attention's
    locals (normed input, Q, K/V, its output) die before the MLP runs: the layer crests at the
    largest of its attention (beside the layer's input), RoPE on Q, and its MLP's gate (the
    input, the residual sum, the normed sum and three [t, f/T] buffers). The loss keeps the
    final norm's output and its logits (two fp32 [t, V/T] buffers, three for the
    vocabulary-parallel cross-entropy)."""
    cfg, e, t = c.cfg, c.e, c.tokens
    nh, kvl, fl, vl = local_dims(cfg, T)
    o = t * nh * cfg.d_head * e  # one attention output (or Q)
    act, kvu, logits = t * cfg.hidden * e, kv_unit(c, kvl), 4 * t * vl
    mlp = 3 * act + (moe_working_set(c, T, experts) if cfg.moe else 3 * t * fl * e)
    loss = act + (3 if vocab_parallel else 2) * logits
    if ring(c):  # the locals are this rank's tokens'; at the crest of a ring step: its K/V
        # stacked and two chunks (in use, in flight), the fp32 output sum, a block's output
        # and the merge's product
        kvp, o32 = 2 * t * kvl * e, 4 * t * nh * cfg.d_head
        return max(mlp, 2 * act + 2 * o + 3 * kvp + 2 * o32), loss
    if hierarchical(c):  # a ring step over the re-sharded heads, as many bytes as a ring
        # rank's, beside the attention's local Q and K/V and the all-to-alls' Q and K/V (a
        # chunk in flight only where the ring has three groups or more); or the output's
        # all-to-all, as Ulysses'
        kvp, o32 = 2 * t * kvl * e, 4 * t * nh * cfg.d_head
        flight = c.cp // cp_inner(c, T) > 2
        ring_step = 2 * act + 2 * o + (4 + flight) * kvp + 2 * o32
        return max(mlp, ring_step, 2 * act + 6 * o + 2 * kvp), loss
    if ulysses(c):  # the locals are this rank's tokens' (the output merges heads by a view)
        kvp = 2 * t * kvl * e
        # the exchanges: K/V's (local, stacked, sent, received, reordered), the output's (Q,
        # its heads, K/V's, the output, sent, received, merged)
        return max(mlp, 2 * act + 2 * o + 4 * kvp, 2 * act + 6 * o + 2 * kvp), loss
    # the attention's locals, W_o's output and the residual sum; or RoPE on Q (the input and
    # normed input, Q, K, the rotated Q and two temporaries; with QK norms the normed Q and K)
    attention = 4 * act + 2 * o + kvu + (c.cp > 1) * o
    k1 = t * kvl * e  # one local K
    rope = 2 * act + 3 * o + k1 + cfg.qk_norm * (o + k1)
    layer = max(attention, rope, mlp)
    if c.cp > 1:  # the K/V gather: local K/V, stacked, gathered, reordered
        layer = max(layer, 2 * act + o + 4 * t * kvl * e + 2 * kvu)
    return layer, loss


def backward_transients(c: Spec, T: int, experts: str = "local") -> tuple[int, int]:
    """Transients of a plain model's backward beyond every saved tensor: at the loss, three
    [t, V/T] fp32 logit copies, one of them saved (so two here); at a layer, the larger of its
    MLP's gate backward (the residual's gradient and three [t, f/T] gradients, less
    silu(h1) * h3, which W2's backward has freed) and, context parallel, its attention's backward
    (the residual's gradient, the attention output's gradient and its copy, and three and a half
    gathered K/V pairs: the gather, its gradient staging, the kernel's gradients; by then the
    MLP's saved tensors and the second norm's input and output are freed; Ulysses: the output
    gradient's all-to-all, four [t, H/T * d] buffers). A MoE MLP's: :func:`moe_backward_t`
    over ``experts``' rows."""
    e, t = c.e, c.tokens
    nh, kvl, fl, vl = local_dims(c.cfg, T)
    act, kvu, logits = t * c.cfg.hidden * e, kv_unit(c, kvl), 4 * t * vl
    layer_t = act + (moe_backward_t(c, T, experts) if c.cfg.moe else 2 * t * fl * e)
    mlp = mlp_saved(c, T, experts)  # freed before the attention's backward
    if ring(c) or hierarchical(c):
        # the ring's backward (a2a+p2p: over the re-sharded heads, as many bytes): the
        # output's gradient and its copy, the fp32 dQ and dK/dV sums (one in flight), two
        # K/V chunks (in use, in flight: a2a+p2p's ring of two groups has none in flight at
        # its last block) and a block's gradients
        kvp, o, o32 = 2 * t * kvl * e, t * nh * c.cfg.d_head * e, 4 * t * nh * c.cfg.d_head
        freed = mlp + 2 * act
        chunks = 3 if ring(c) else 2 + (c.cp // cp_inner(c, T) > 2)
        layer_t = max(layer_t, act + 3 * o + o32 + 2 * kvp * FP32 // e + chunks * kvp - freed)
    elif c.cp > 1 and ulysses(c):
        # Ulysses: the output's all-to-all backward (its gradient, sent, received, reordered)
        # beside the residual's gradient; fitted to the fake-tensor peaks (within 1% where it
        # crests), which do not grow with K/V there and see no MLP tensor freed yet
        layer_t = max(layer_t, act + 4 * t * nh * c.cfg.d_head * e)
    elif c.cp > 1:
        freed = mlp + 2 * act
        layer_t = max(layer_t, act + 2 * t * nh * c.cfg.d_head * e + 7 * kvu // 2 - freed)
    return 2 * logits, layer_t


# -- fully sharded units (FSDP+CP, FSDP2+CP) --------------------------------------------------
def gathered_unit_working_set(
    c: Spec, base: tuple[int, int], units: tuple[int, int, int], prefetch: bool
) -> tuple[int, int]:
    """``base`` (layer, loss) working sets of a forward-only step, plus the gathered unit in use
    (a layer: one layer's weights; the loss: the final norm and the LM head) and, with
    ``prefetch``, the next unit's gather in flight beside a layer (the top layer's: the head
    unit). ``units``: the gathered (padded) bytes of the embedding, a layer, the head unit."""
    cfg, e = c.cfg, c.e
    layer, loss = base
    _, ul, un = units
    # (a strategy with experts here keeps them outside its units: FSDP+CP's expert
    # parallelism; FSDP2+CP runs dense models only)
    layer += (layer_numel(cfg) - expert_numel(cfg)) * e + (max(ul, un) if prefetch else 0)
    return layer, loss + (cfg.vocab * cfg.hidden + cfg.hidden) * e


def gathered_unit_transients(
    c: Spec, base: tuple[int, int, int], units: tuple[int, int, int], prefetch: bool,
    saved_per_layer: int,
) -> tuple[int, int, int]:  # fmt: skip
    """``base`` backward transients (loss, layer, end) plus, with ``prefetch``, a layer's
    backward's prefetched gather of the layer below and the gradient of the unit above still
    reduce-scattering (its shard, then in flight, is the gradient it would hold already). At the
    top layer that unit is the head; below, a layer, once the layer above's saved tensors (under
    recomputation its input) are freed."""
    loss_t, layer_t, end_t = base
    if prefetch and c.cfg.layers > 1:
        _, ul, un = units
        act = c.tokens * c.cfg.hidden * c.e  # a layer's input
        freed = act if c.rc else saved_per_layer
        layer_t += ul + max(un, ul - freed)
    elif prefetch:
        layer_t += units[2]
    return loss_t, layer_t, end_t


class Costs(ABC):
    """A strategy's closed forms per rank: what the analytic and cost models ask of it (its
    ``costs``), never instantiated with state. The defaults are a plain autograd model (the
    functions above) whose GEMM weights are split ``tensor_degree`` ways; a strategy overrides
    what its code does differently (docs/method.md section 6: communication, 7: memory). What
    no default can answer without lying (a schedule of 0 bytes, a weight split of 1, metrics
    reduced nowhere) is abstract: a strategy that forgets one cannot be instantiated."""

    loss_head_passes: int = 3  # LM-head GEMMs per training step (forward, 2 backward)
    recompute_skips_w2: bool = True  # the recomputed forward stops after the last op that
    # saves a tensor: in a plain autograd layer, before the final W2 GEMM
    vocab_parallel_loss: bool = False  # Megatron's vocabulary-parallel cross-entropy
    grad_staging_copies: int = 0  # packed copies of all grads reduced after backward

    @abstractmethod
    def tensor_degree(self, layout: Layout) -> int:
        """Ranks each GEMM's weight is split over (1: every rank applies whole weights)."""

    @abstractmethod
    def schedule(self, spec: Spec) -> Schedule:
        """The model group's collectives one rank issues in a step (data parallelism apart)."""

    @abstractmethod
    def metric_reductions(self, layout: Layout, train: bool) -> tuple[int, int]:
        """Group sizes of the all-reduces of the reported loss (over the ranks that split tokens)
        and of the gradient norm (training: over the ranks that split weights); 1: none."""

    def weight_split(self, layout: Layout) -> int:
        """Ranks each weight is stored split over: the per-rank GEMM width, the head grad's rows."""
        return self.tensor_degree(layout)

    def param_numel(self, cfg: ModelConfig, layout: Layout) -> int:
        """Parameter elements held by one rank (what the optimizer steps)."""
        return split_numel(cfg, self.tensor_degree(layout))

    def saved_per_layer(self, spec: Spec) -> int:
        """Bytes one layer keeps for backward (no recomputation)."""
        return saved_per_layer(spec, self.tensor_degree(spec.layout), self.experts_meet(spec))

    def saved_loss(self, spec: Spec) -> int:
        """Bytes the final norm and the loss keep for backward."""
        return saved_loss(spec, self.tensor_degree(spec.layout), self.vocab_parallel_loss)

    def inference_working_set(self, spec: Spec) -> tuple[int, int]:
        """Transient bytes of a forward-only step: (in a layer, in the loss)."""
        T = self.tensor_degree(spec.layout)
        return inference_working_set(spec, T, self.vocab_parallel_loss, self.experts_meet(spec))

    def backward_transients(self, spec: Spec) -> tuple[int, int, int]:
        """Transient bytes at the loss's backward, a layer's backward and the end of backward."""
        staging = self.grad_staging_copies * self.param_numel(spec.cfg, spec.layout) * spec.e
        T = self.tensor_degree(spec.layout)
        return (*backward_transients(spec, T, self.experts_meet(spec)), staging)

    def experts_meet(self, spec: Spec) -> str:
        """How a model's tokens meet its experts (:func:`routed_saved`): by default, plain
        autograd on this rank's experts and tokens (``local``)."""
        return "local"

    def stage_held(self, spec: Spec, numel: int) -> tuple[int, int]:
        """A pipeline stage's bytes beyond its ``numel`` parameter elements that it keeps over
        its micro-batches: (weights, from the first forward to the schedule's end; gradients,
        from the first backward to their reduction after it). None by default."""
        return 0, 0
