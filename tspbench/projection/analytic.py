"""Closed-form cost of one step per rank: bytes by collective and phase, FLOPs, memory by part.

What depends on the strategy is the strategy's own: this module asks its cost classmethods
(:class:`tspbench.core.strategy.Strategy`; the formulas the baselines share are in
tspbench/core/costs.py, TSP's in tsp_impl/costs.py) and never switches on a strategy's name.
Each strategy writes its schedule out as the list of collectives it issues (docs/method.md
section 6, extended to backward, recomputation, embeddings and the loss; the data-parallel
gradient all-reduce is appended here), and bytes are counted with the same :func:`bus_bytes`
rule as the measured counter, so the two must agree exactly; tests assert it. FLOPs are what
the FLOP counter counts: matmuls (2mnk) and the attention kernel's formula over the (query, key)
pairs its causal mask keeps (4 b h d per pair forward, 2.5 times that backward), model FLOPs
(no recomputation) or executed ones.
Memory is model state plus saved activations plus the largest transient, per part (section 7);
see :func:`memory`.

Notation (docs/method.md section 1): B micro-batch, S sequence, h hidden, kv = n_kv*d, f MLP size,
V vocabulary, L layers, e bytes per element; t = tokens on this rank.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TypedDict

from tspbench.core.comm import KINDS, bus_bytes
from tspbench.core.config import ModelConfig
from tspbench.core.costs import Event, Schedule, expert_rows, routing_counts
from tspbench.core.mesh import Axis
from tspbench.runtime.spec import RunSpec

KINDS_COLLECTIVE = tuple(k for k in KINDS if k != "send_recv")  # group-wide, not point-to-point


# -- parameters -------------------------------------------------------------------------------
def param_numel(c: RunSpec) -> int:
    """Parameter elements held by one rank (what the optimizer steps)."""
    return c.impl.costs.param_numel(c.cfg, c.layout)


# -- communication ----------------------------------------------------------------------------
def schedule(c: RunSpec) -> list[Event]:
    """Every collective one rank issues in a step, with its phase, mesh axis and group size:
    the strategy's model group's, then the gradient all-reduce over data-parallel replicas."""
    ev = Schedule(c.impl.costs.schedule(c))
    if c.dp > 1:  # the load-balancing loss's counts over the replicas too (routing_done)
        routing_counts(c, ev, Axis.DP, c.dp)
    if c.train and c.dp > 1:
        # DDP-style buckets, each issued while the backward goes on (tspbench/core/grad_sync.py)
        ev.add(Axis.DP, Axis.DP, "all_reduce", c.dp, param_numel(c) * c.e, overlapped=True)
    return ev


def comm_bytes(c: RunSpec) -> dict[tuple[str, str], float]:
    """Bytes one rank moves per step, by (phase, collective kind), the counter's convention."""
    out: dict[tuple[str, str], float] = defaultdict(float)
    for phase, _, kind, size, nbytes in schedule(c):
        if size > 1:
            out[(phase, kind)] += bus_bytes(kind, nbytes, size)
    return dict(out)


def crossover(
    cfg: ModelConfig, one: str, other: str, mode: str, recompute: str, degree: int = 8
) -> float:
    """B x S above which strategy ``one`` moves fewer bytes per rank than ``other`` at degree D
    and bf16 (both linear in S at B = 1; infinity: never)."""
    return _crossover(cfg, (one, {}), (other, {}), mode, recompute, degree)


def expert_crossover(cfg: ModelConfig, mode: str, recompute: str, degree: int) -> float:
    """B x S above which TSP's experts moving round the ring (``moe_schedule=ring``) move fewer
    bytes per rank than its all-to-all of token rows (expert parallelism) at degree D and bf16:
    per layer and pass the rows' 2 k t h against the experts' 3 h f_e E, (D-1)/D of each,
    under even routing (infinity: never)."""
    return _crossover(
        cfg, ("tsp", {"moe_schedule": "ring"}), ("tsp", {"moe_schedule": "all_to_all"}),
        mode, recompute, degree,
    )  # fmt: skip


def _crossover(
    cfg: ModelConfig, one: tuple[str, dict], other: tuple[str, dict], mode: str, recompute: str,
    degree: int,
) -> float:  # fmt: skip
    def total(s: tuple[str, dict], S: int) -> float:
        spec = RunSpec.make(
            s[0], cfg, degree=degree, seq_len=S, mode=mode, dtype="bf16", recompute=recompute,
            **s[1],
        )  # fmt: skip
        return sum(comm_bytes(spec).values())

    a, b = 16 * degree, 4096 * degree
    slope = {k: (total(s, b) - total(s, a)) / (b - a) for k, s in (("one", one), ("other", other))}
    base = {k: total(s, a) - slope[k] * a for k, s in (("one", one), ("other", other))}
    if slope["other"] <= slope["one"]:
        return float("inf")
    return (base["one"] - base["other"]) / (slope["other"] - slope["one"])


def comm_by_kind(c: RunSpec) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for (_, kind), b in comm_bytes(c).items():
        out[kind] += b
    return dict(out)


# -- FLOPs ------------------------------------------------------------------------------------
def attention_pairs(c: RunSpec) -> int:
    """(query, key) pairs the causal kernel calls of one sequence and head compute on this rank
    (:func:`tspbench.core.attention.causal_pairs`, the counter's rule).

    One rank holds zigzag chunks r and 2P-1-r of size s = S/2P; chunk j sees j s keys in full
    and its diagonal s x s block causally (whether one call or the CPU kernel's prefix and
    diagonal block), so every rank has (2P-1) s^2 + s(s+1) = 2P s^2 + s, and the P ranks
    together S(S+1)/2, as one causal call over S (P = 1).
    """
    P, S = c.cp, c.seq_len
    if P == 1:
        return S * (S + 1) // 2
    s = S // (2 * P)
    return 2 * P * s * s + s


def expert_mlp_per_token(cfg: ModelConfig, T: int) -> int:
    """Multiply-adds of one MoE layer's MLP per token on a rank whose GEMM weights are split T
    ways: the router [E, h] (whole), k experts' W1, W3, W2 (the rows they get 1/T of the
    tokens' under even routing, as TP's experts are split over its group; exact with k = E),
    and a shared expert's three and its gate."""
    h = cfg.hidden
    shared = 3 * h * cfg.shared_ffn // T + h if cfg.shared_ffn else 0
    return h * cfg.experts + 3 * cfg.top_k * cfg.moe_ffn * h // T + shared


def flop_parts(c: RunSpec, model: bool = False, loss: bool = True) -> dict[str, int]:
    """FLOPs one rank executes per step, GEMMs and attention apart, as the FLOP counter counts
    them (:mod:`tspbench.runtime.flops`); ``model``: without what is recomputed (MFU's count);
    ``loss`` off, forward only: a decoder's prefill, whose LM head multiplies the last position
    of each sequence, by the rank's share of the head."""
    cfg, B, impl = c.cfg, c.batch, c.impl
    h, kv, f, V, L, d = cfg.hidden, cfg.kv_dim, cfg.ffn, cfg.vocab, cfg.layers, cfg.d_head
    t = c.tokens
    T = impl.costs.tensor_degree(c.layout)  # weight split of the GEMMs on a rank
    seqs = B // impl.replica_batch(c.layout)  # sequences of the micro-batch on this rank
    if not cfg.moe:  # one layer, forward
        gemm = 2 * t * (2 * h * cfg.q_dim + 2 * h * kv + 3 * h * f) // T
    else:
        gemm = 2 * t * (2 * h * cfg.q_dim + 2 * h * kv) // T + 2 * t * expert_mlp_per_token(cfg, T)
    attn = 4 * seqs * (cfg.heads // T) * d * attention_pairs(c)  # one layer, forward
    head = 2 * t * h * V // T if loss else 2 * c.batch * h * V // impl.costs.weight_split(c.layout)
    if not c.train:
        return {"gemm": L * gemm + head, "attention": L * attn}
    # backward: GEMMs twice, attention 2.5x; a loss may recompute its logits (TSP's, shard by
    # shard: loss_head_passes)
    g = L * 3 * gemm + (3 if model else impl.costs.loss_head_passes) * head
    a = L * (attn + 5 * attn // 2)
    if c.rc and not model:  # autograd's recompute stops after the last op that saves a tensor:
        # custom layers that save at their very end recompute everything; a plain autograd
        # layer skips its final W2 GEMM (recompute_skips_w2); a MoE block ends in the
        # weighted sum of its experts' outputs: its recompute runs every GEMM
        skips = impl.costs.recompute_skips_w2 and not cfg.moe
        g += L * (gemm - (2 * t * f * h // T if skips else 0))
        a += L * attn
    return {"gemm": g, "attention": a}


def flops(c: RunSpec, model: bool = True, loss: bool = True) -> int:
    """FLOPs one rank counts per step: model FLOPs (the record's ``flops_per_step`` share), or
    with ``model`` False all it executes (``loss``: as :func:`flop_parts`)."""
    return sum(flop_parts(c, model, loss).values())


def gemm_size(c: RunSpec) -> float:
    """Equivalent square size of the step's typical GEMM (tokens x hidden x per-rank width; with
    experts, an expert's rows x hidden x f_e), the cube root of its m*n*k: what a GEMM rate
    table is looked up with."""
    cfg = c.cfg
    if cfg.moe:  # the experts' GEMMs, most of a MoE layer's FLOPs: one expert's rows under
        # even routing by its whole f_e (every strategy here keeps experts whole)
        costs = c.impl.costs
        rows = expert_rows(c, costs.tensor_degree(c.layout), costs.experts_meet(c))[1]
        return (rows * cfg.hidden * cfg.moe_ffn) ** (1 / 3)
    width = (cfg.hidden + cfg.ffn) / 2 / c.impl.costs.weight_split(c.layout)  # on one rank
    return (c.tokens * cfg.hidden * width) ** (1 / 3)


def elementwise_bytes(c: RunSpec) -> float:
    """Rough memory traffic of the non-GEMM work: every saved activation written and read once
    per pass (forward, backward, recompute), and AdamW's passes over weights, grads, moments."""
    act = c.cfg.layers * saved_per_layer(c) + saved_loss(c)
    if not c.train:
        return 2.0 * act
    passes = 6 if c.rc else 4
    return passes * act + 16 * 4 * param_numel(c)


# -- memory -----------------------------------------------------------------------------------
def saved_per_layer(c: RunSpec) -> int:
    """Bytes one layer keeps for backward (no recomputation), from what each op saves."""
    return c.impl.costs.saved_per_layer(c)


def saved_loss(c: RunSpec) -> int:
    """Bytes the final norm and the loss keep for backward."""
    return c.impl.costs.saved_loss(c)


class Memory(TypedDict, total=False):
    """What :func:`memory` returns: bytes per rank by part, the peaks, and where it crests."""

    weights: float
    master_weights: float
    grads: float
    optimizer: float
    saved_activations: float
    transient: float
    peak_first: float
    peak: float
    peak_at: str


def memory(c: RunSpec, loss: bool = True) -> Memory:
    """Bytes per rank by part, and the peak of the first step and of the steady state
    (``loss`` off, forward only: a decoder's prefill, which computes one position's logits,
    not the loss over every token's; its [B, V/T] row is not modelled).

    The peak is the largest of the moments where a step's memory crests, each a sum of parts:
      loss backward    saved activations + the loss's transients (logit buffers; TSP: one
                       vocabulary shard's recomputed logits, three copies; others: three
                       [t, V/T] fp32 copies, one of them saved) + the LM head's gradient
      layer backward   saved activations + the top layer's backward: the attention's gathered
                       K/V and its gradient staging (TSP: four copies of one head group's K/V
                       over the sequence; context parallel: one and a half gathered K/V pairs),
                       or the MLP's SiLU backward (three [t, f/T] buffers; TSP: five, and the
                       slice and accumulator in flight) + the LM head's gradient
      end of backward  all gradients + the gradient reduction's staging (TSP: the embedding
                       gradient's [V, h] buffer, twice; SP/DP/TP+SP: one packed copy)
      optimizer step   all gradients + AdamW moments (+ fp32 gradient copies for bf16 weights)
      inference        the layer's working set: a plain layer's attention (its locals, W_o's
                       output) or its MLP's gate (the locals die in between); TSP's gather
                       stages three copies of a head group's K/V; or the loss's logits
    The transients are the strategy's (``inference_working_set``, ``backward_transients``).
    Activations under recomputation: each layer keeps its input, and the top layer's saved
    tensors come back while its backward runs. The tests compare the result with measured and
    fake-tensor peaks.
    """
    cfg, e, t, impl = c.cfg, c.e, c.tokens, c.impl
    h, V, L = cfg.hidden, cfg.vocab, cfg.layers
    n = param_numel(c)
    act = t * h * e  # one [t, h] activation
    weights, masters = n * e, (4 * n if c.train and e != 4 else 0)
    rest = weights + masters + 16 * t  # + int64 tokens and labels
    parts: Memory = {
        "weights": weights,
        "master_weights": masters,
        "grads": n * e if c.train else 0,
        "optimizer": 8 * n if c.train else 0,
    }
    if not c.train:
        layer, loss_work = impl.costs.inference_working_set(c)
        work = max(layer, loss_work) if loss else layer
        parts.update({"saved_activations": 0, "transient": work, "peak_at": "inference"})
        parts["peak_first"] = parts["peak"] = rest + work
        return parts
    per_layer, loss_saved = saved_per_layer(c), saved_loss(c)
    layers = L * act if c.rc else L * per_layer  # checkpointing keeps each layer's input
    head_grad = V // impl.costs.weight_split(c.layout) * h * e
    loss_t, layer_t, end_t = impl.costs.backward_transients(c)
    # the recomputed top layer's saved tensors, less its first norm's input: the layer input,
    # which the checkpoint keeps already
    top = per_layer - act if c.rc else 0
    crests = {
        "loss backward": rest + layers + loss_saved + loss_t + head_grad,
        "layer backward": rest + layers + top + layer_t + head_grad,
        "end of backward": rest + n * e + end_t,
    }
    # fused AdamW: moments and fp32 gradient copies for bf16 weights, no temporaries
    opt = rest + n * e + 8 * n + (4 * n if e != 4 else 0)
    at = max(crests, key=lambda k: crests[k])
    parts.update(
        {"saved_activations": layers + loss_saved, "transient": crests[at] - rest - layers}
    )
    first = max(crests[at], opt)
    steady = max(crests[at] + 8 * n, opt)
    parts.update({"peak_first": first, "peak": steady})
    parts["peak_at"] = at if steady > opt else "optimizer step"
    return parts
