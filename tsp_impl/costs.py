"""TSP's closed forms per rank: its parameters, its schedule of collectives, its memory.

What :class:`tsp_impl.model.TSP` answers when the analytic and cost models ask (its ``costs``, a
:class:`TSPCosts`: the methods of :class:`tspbench.core.costs.Costs`), written next to the
schedules they count: the
broadcast attention (attention.py), the ring or broadcast MLP (mlp.py, ``mlp_schedule``) and the
vocabulary-parallel embedding and loss (vocab.py). docs/method.md section 6 (communication) and
section 7 (memory).

Notation (docs/method.md section 1): B micro-batch, S sequence, h hidden, kv = n_kv*d, f MLP size,
V vocabulary, L layers, e bytes per element, D the degree; t = tokens on this rank.
"""

from __future__ import annotations

from tsp_impl.attention import bias_rows
from tsp_impl.mlp import bias_rows as mlp_bias_rows
from tsp_impl.plan import bucket_count
from tspbench.core import costs
from tspbench.core.config import ModelConfig
from tspbench.core.costs import FP32, Schedule, Spec
from tspbench.core.mesh import Axis
from tspbench.core.strategy import Layout


def param_numel(cfg: ModelConfig, D: int) -> int:
    """Every weight but the norms and output biases is 1/D per rank: head group, MLP slice,
    vocabulary rows; a head group's QKV biases (Qwen2) ride in zero-padded rows of its attention
    shard, an MLP slice's b1, b3 (Llama's mlp_bias) in those of its slice."""
    biases = (cfg.q_dim + 2 * cfg.kv_dim) // D if cfg.qkv_bias else 0
    mlp = 3 * cfg.ffn * cfg.hidden // D + (2 * cfg.ffn // D if cfg.mlp_bias else 0)
    return costs.split_numel(cfg, D) + cfg.layers * (
        attn_shard_numel(cfg, D) - _plain(cfg, D) - biases + mlp_slice_numel(cfg, D) - mlp
    )


def mlp_slice_numel(cfg: ModelConfig, D: int) -> int:
    """Elements of one packed MLP slice: [W1_s; W3_s; W2_s^T] and the biases' rows."""
    n = cfg.ffn // D
    return (3 * n + (mlp_bias_rows(n, cfg.hidden) if cfg.mlp_bias else 0)) * cfg.hidden


def _plain(cfg: ModelConfig, D: int) -> int:
    return (2 * cfg.q_dim + 2 * cfg.kv_dim) * cfg.hidden // D


def attn_shard_numel(cfg: ModelConfig, D: int) -> int:
    """Elements of one packed attention shard: [Wq_r; Wk_r; Wv_r; Wo_r^T] and the biases' rows."""
    return _plain(cfg, D) + bias_rows(cfg, D) * cfg.hidden


def schedule(c: Spec, loss: bool = True) -> Schedule:
    """Every shard of every weight is broadcast by its owner (attention, embedding, LM head; the
    MLP's with ``mlp_schedule = broadcast``) or passed around the ring (the MLP's); one head
    group's K/V are all-gathered along the sequence (``kv_exchange = ring``: passed round the
    ring, each bucket's pair in D - 1 hops, and in backward again with the fp32 dK/dV sums, whose
    last hop brings each rank its own). In backward the weights come again, and
    their gradients are reduced to their owners (the ring's accumulators travel behind them).
    ``loss`` off: the forward pass without the LM head's loss (a decoder's prefill).

    Overlapped (``ov``: with ``overlap`` on), as the code does it (tsp_impl/overlap.py, mlp.py):
    each broadcast loop prefetches shard r+1 while shard r computes (its first broadcast is
    waited for at once); every ring hop is in flight during a step's GEMMs but the backward's
    last accumulator hop; a weight-gradient reduce drains while the next gradient computes (its
    last is waited for at once; attention's and the vocabulary's even with overlap off). K/V
    gathers, their reduce-scatters and the norms' all-reduce are blocking; the K/V ring's hops
    hide behind the blocks but the last dK/dV hop of each bucket."""
    cfg, B, S, e, D = c.cfg, c.batch, c.seq_len, c.e, c.degree
    h, kv, V, L = cfg.hidden, cfg.kv_dim, cfg.vocab, cfg.layers
    wa, wv = attn_shard_numel(cfg, D) * e, V // D * h * e
    kv_full = 2 * B * S * kv // D * e  # one head group's K and V over the whole sequence
    ev, M = Schedule(), Axis.MODEL
    ov = c.options["overlap"]
    costs.routing_counts(c, ev, M, D)  # with experts, the loss's counts; all_to_all's rows
    if cfg.moe and c.options.get("moe_schedule", "all_to_all") == "all_to_all":
        costs.dispatch_combine(c, ev, M, D)
    kv_ring = kv_exchange_ring(c)
    # the ring's hops: per head group, each bucket's local K/V pair [2, B, b, S/D, d]
    buckets = bucket_count(kv // cfg.d_head // D, int(c.options["kv_bucket"]))
    kv_hop, hops = 2 * c.tokens * kv // D // buckets, D * buckets * (D - 1)

    def kv_fwd(phase: str) -> None:
        if kv_ring:  # each arriving pair sent on before its block is computed
            ev.add(phase, M, "send_recv", D, kv_hop * e, hops, overlapped=ov)
        else:
            ev.add(phase, M, "all_gather", D, kv_full, D)

    def layer_fwd(phase: str) -> None:
        ev.add(phase, M, "broadcast", D, wa, D, overlapped=ov, exposed=1)
        kv_fwd(phase)
        mlp_events(c, ev, phase)

    ev.add("forward", M, "broadcast", D, wv, D, overlapped=ov, exposed=1)  # embedding shards
    for _ in range(L):
        layer_fwd("forward")
    if loss:
        ev.add("forward", M, "broadcast", D, wv, D, overlapped=ov, exposed=1)  # LM head shards
    if c.train:
        ev.add("backward", M, "broadcast", D, wv, D, overlapped=ov, exposed=1)
        ev.add("backward", M, "reduce", D, wv, D, overlapped=True, exposed=1)
        for _ in range(L):
            if c.rc:
                layer_fwd("backward")
            ev.add("backward", M, "broadcast", D, wa, D, overlapped=ov, exposed=1)
            if kv_ring:  # K/V round again, the fp32 dK/dV sums a hop behind; the last exposed
                ev.add("backward", M, "send_recv", D, kv_hop * e, hops, overlapped=ov)
                ev.add("backward", M, "send_recv", D, kv_hop * FP32, hops, overlapped=ov)
                ev.add("backward", M, "send_recv", D, kv_hop * FP32, D * buckets)
            else:
                if c.options["kv_backward"] == "regather":  # (save: the forward's are kept)
                    ev.add("backward", M, "all_gather", D, kv_full, D)
                ev.add("backward", M, "reduce_scatter", D, kv_full, D)
            ev.add("backward", M, "reduce", D, wa, D, overlapped=True, exposed=1)
            mlp_events(c, ev, "backward", gradients=True)
        # embedding grad, owner by owner
        ev.add("backward", M, "reduce", D, wv, D, overlapped=True, exposed=1)
        n = costs.replicated_numel(cfg) * e  # norms, bo, b2, routers, in finish_grads
        ev.add("backward", M, "all_reduce", D, n, per_step=True)
    return ev


def mlp_events(c: Spec, ev: Schedule, phase: str, gradients: bool = False) -> None:
    """One layer's MLP weights on the move (``gradients``: with their gradients going home):
    its slices round the ring or broadcast (``mlp_schedule``); with experts, the experts' blocks
    by ``moe_schedule`` ring or broadcast (all_to_all moves rows instead: dispatch_combine) and a
    shared expert's slices as the MLP's. The ring: D-1 slice hops forward; backward the slices'
    D-1 hops and D accumulator hops. Broadcast: D forward; backward D, and D reduces."""
    cfg, D, e, ov, M = c.cfg, c.degree, c.e, c.options["overlap"], Axis.MODEL
    ring = c.options["mlp_schedule"] == "ring"
    moving: list[tuple[int, bool]] = []  # (bytes of one rank's block, round the ring)
    if not cfg.moe:
        moving.append((mlp_slice_numel(cfg, D) * e, ring))
    else:
        schedule = c.options.get("moe_schedule", "all_to_all")
        if schedule != "all_to_all":
            moving.append((costs.expert_numel(cfg) // D * e, schedule == "ring"))
        if cfg.shared_ffn:
            moving.append((3 * cfg.shared_ffn // D * cfg.hidden * e, ring))
    for w, by_ring in moving:
        if by_ring:
            hops, shown = (2 * D - 1, 1) if gradients else (D - 1, 0)
            ev.add(phase, M, "send_recv", D, w, hops, overlapped=ov, exposed=shown)
        else:
            ev.add(phase, M, "broadcast", D, w, D, overlapped=ov, exposed=1)
            if gradients:
                ev.add(phase, M, "reduce", D, w, D, overlapped=ov, exposed=1)


def kv_exchange_ring(c: Spec) -> bool:
    """Whether head groups' K/V go round the ring (``kv_exchange = ring``, D > 1)."""
    return c.options["kv_exchange"] == "ring" and c.degree > 1


def saved_per_layer(c: Spec) -> int:
    """Bytes one layer keeps for backward: the norms' and, per head group, the local [Q K_p V_p]
    (one tensor), A and the lse (and with ``kv_backward = save`` its gathered K/V over the
    sequence); per MLP slice [h1 h3] (one tensor), or a MoE MLP's (:func:`moe_saved`)."""
    cfg, e, t = c.cfg, c.e, c.tokens
    q, kv = cfg.q_dim, cfg.kv_dim
    kept = c.degree * _units(c)[1] if c.options["kv_backward"] == "save" else 0
    attn = costs.norms_saved(c) + (2 * t * q + 2 * t * kv) * e + 4 * t * cfg.heads + kept
    return attn + _mlp_saved(c)


def _how(c: Spec) -> str:
    """How the tokens meet the experts (tspbench/core/costs.py ``routed_saved``)."""
    return "dispatch" if c.options["moe_schedule"] == "all_to_all" else "moving"


def _block(c: Spec) -> int:
    """Bytes of one rank's packed experts [E/D x 3 f_e, h]."""
    cfg = c.cfg
    return cfg.experts // c.degree * 3 * cfg.moe_ffn * cfg.hidden * c.e


def _mlp_saved(c: Spec) -> int:
    """What the MLP keeps for backward, freed before the attention's backward runs."""
    return moe_saved(c) if c.cfg.moe else 2 * c.tokens * c.cfg.ffn * c.e


def moe_t(c: Spec) -> int:
    """A MoE MLP's backward crest beyond dX and dY (tspbench/core/costs.py ``moe_backward_t``):
    moving experts hold blocks as the dense MLP's slices (:func:`mlp_t`): the ring, the block
    in use and the one arriving and three gradient accumulators (one written, one sent, one
    arriving; each step writes a new one), min(D + 2, 5); the broadcast, min(D, 4) and the
    gradient being written; a shared expert's slices are the dense MLP's."""
    D = c.degree
    blocks = 0
    if _how(c) == "moving" and D > 1:
        ring_ = c.options["moe_schedule"] == "ring"
        blocks = (min(D + 2, 5) if ring_ else min(D, 4) + 1) * _block(c)
    routed = costs.moe_backward_t(c, 1, _how(c), blocks)
    return max(routed, mlp_t(c, costs.dense_shared(c.cfg))) if c.cfg.shared_ffn else routed


def moe_saved(c: Spec) -> int:
    """A MoE MLP's: the router's, the routed experts' over the t k rows of this rank's tokens
    (all_to_all: as the dispatcher keeps them; ring, broadcast: [h1 h3] and the output of
    each), and a shared expert's as a dense MLP's slices."""
    cfg, t = c.cfg, c.tokens
    routed = costs.routed_saved(c, t * cfg.top_k, _how(c))
    return costs.route_saved(c) + routed + costs.shared_saved(c, 2 * t * cfg.shared_ffn * c.e)


def saved_loss(c: Spec) -> int:
    """The final norm's, and the log-sum-exp: the logits are recomputed."""
    return costs.final_norm_saved(c) + 4 * c.tokens


def _units(c: Spec) -> tuple[int, int, int]:
    """(one [t, h] activation, one gathered K/V pair of a head group, one shard's fp32 logits)."""
    cfg, D = c.cfg, c.degree
    act = c.tokens * cfg.hidden * c.e
    return act, costs.kv_unit(c, cfg.kv_dim // D), 4 * c.tokens * (cfg.vocab // D)


def plan_tables(c: Spec) -> int:
    """The plan's tables, built in the first step and kept (tsp_impl/plan.py): the RoPE
    rotations [S/D, 2, 2, d/2], the int32 gather order [S] and gradient scatter rows (2 (S + c),
    c = S/2D; 2S at D = 1)."""
    S, D = c.seq_len, c.degree
    rows = 2 * S if D == 1 else 2 * (S + S // (2 * D))
    return 2 * S // D * c.cfg.d_head * c.e + 4 * S + 4 * rows


def inference_working_set(c: Spec) -> tuple[int, int]:
    """(layer, loss), with the plan's tables. The layer: the larger of
    - attention, at the K/V gather of a head group r > 0: the layer input, its normed copy and
      Y; this attention shard and the next; the group's [Q K V]; the gathered K/V and its copy
      in global order (the previous group's tensors are freed by then); with the K/V ring,
      instead of the gathered pair, the ring's crest (:func:`ring_forward_crest`);
    - MLP, at a slice s > 0: the layer input, x + attention, its normed copy, Y; this slice's
      [h1 h3] and its gate; this slice and the next; a MoE MLP: its experts' crest
      (tspbench/core/costs.py ``moe_working_set``) and, moving them, another rank's block in
      use and (D > 2) the next in flight, or a shared expert as the dense MLP's slices;
    - the embedding, at an owner r > 0: this shard and the next, the output so far, this
      owner's lookup and the merged output (what a prefill, which has no loss, crests at when
      the vocabulary is large against the local tokens);
    at D = 1 there is no previous group or slice, no Y yet and no shard in flight.
    The loss: a shard's logits in x's dtype and in fp32, the head shard in use and in flight."""
    cfg, e, t, D = c.cfg, c.e, c.tokens, c.degree
    h, kv, vl = cfg.hidden, cfg.kv_dim, cfg.vocab // D
    act, kv_unit, logits = _units(c)
    wa, sl, tf = attn_shard_numel(cfg, D) * e, mlp_slice_numel(cfg, D) * e, t * cfg.ffn // D * e
    many = int(D > 1)
    exchange = ring_forward_crest(c) if kv_exchange_ring(c) else 2 * kv_unit
    attn = (2 + many) * act + t * (cfg.q_dim + 2 * kv) // D * e + exchange
    attn += many * 2 * wa
    mlp = 4 * act + 3 * tf + many * 2 * sl
    if cfg.moe:  # the experts' crest: moving, another rank's block in use and the next in
        # flight (D > 2; the own block is a parameter); a shared expert runs as the dense
        # MLP's slices beside the routed output
        moving = _how(c) == "moving"
        mlp = 3 * act + costs.moe_working_set(c, 1, _how(c), shared=False)
        mlp += moving * min(D - 1, 2) * _block(c)
        if cfg.shared_ffn:
            sf = t * cfg.shared_ffn // D * e
            shared = mlp_slice_numel(costs.dense_shared(cfg), D) * e
            mlp = max(mlp, 5 * act + 3 * sf + many * 2 * shared)
    embed = 3 * act + many * 2 * vl * h * e
    loss = 2 * act + logits + t * vl * e + 2 * vl * h * e
    return max(attn, mlp, embed) + plan_tables(c), loss + plan_tables(c)


def backward_transients(c: Spec) -> tuple[int, int, int]:
    """With the plan's tables: at the loss, one vocabulary shard's recomputed logits (in x's
    dtype and two fp32 copies), and the head shard and its gradient in flight; at a layer: the
    MLP's SiLU backward with its slices in flight (:func:`mlp_t`; a MoE MLP's: :func:`moe_t`),
    or the attention's: the
    gathered K/V of a head group, the chunks' dK/dV and dA, less the top layer's MLP saved
    tensors (counted among the saved, freed by then); with QK norms, the head group's normed
    [Q K V], recomputed from its saved projection. On CPU the longer chunk's kernel call is
    split at the diagonal and its dK/dV concatenated: two more copies of its keys' K/V. With
    the K/V ring: the ring's crest (:func:`ring_backward_crest`) and dA, less the MLP's saved
    tensors and its norm's input and output. At the
    end: the embedding gradient, one owner's [V/D, h] filling and one in flight, and a masked
    copy of dx."""
    cfg, e, D, t = c.cfg, c.e, c.degree, c.tokens
    h, vl = cfg.hidden, cfg.vocab // D
    act, kv_unit, logits = _units(c)
    tables = plan_tables(c)
    loss_t = 2 * logits + t * vl * e + act + 2 * vl * h * e
    if kv_exchange_ring(c):
        # the MLP's norm (its input and output, freed with the MLP's saved tensors) is gone too
        attn_t = ring_backward_crest(c) + t * cfg.q_dim // D * e - _mlp_saved(c) - 2 * act
    else:
        kv = 2 * kv_unit if D == 1 else 3 * kv_unit + kv_unit // (2 * D)
        kv -= (
            kv_unit if c.options["kv_backward"] == "save" else 0
        )  # kept among the saved, not gathered again
        attn_t = kv + t * cfg.q_dim // D * e - _mlp_saved(c)
    if cfg.qk_norm:  # the group's [Q K V] normed again from the saved projection (attention.py)
        attn_t += t * (cfg.q_dim + 2 * cfg.kv_dim) // D * e
    layer_t = 2 * act + max(attn_t, moe_t(c) if cfg.moe else mlp_t(c))
    return loss_t + tables, layer_t + tables, 2 * vl * h * e + act + tables


def _ring_units(c: Spec) -> tuple[int, int, int]:
    """(one head group's local attention output, its local K/V pair, its fp32 log-sum-exps)."""
    cfg, t, D = c.cfg, c.tokens, c.degree
    return t * cfg.q_dim // D * c.e, 2 * t * cfg.kv_dim // D * c.e, 4 * t * cfg.heads // D


def ring_forward_crest(c: Spec) -> int:
    """A head group's ring attention forward at its crest (core/ring_attention.py), on the
    rank whose blocks are largest (the last: every block but the first covers all its queries):
    at the first block, the group's packed K/V and the buffer the next pair arrives in, the
    block's output (and its fp32 copy, unless fp32); at a later block, the pair in use and (D > 2)
    the next in flight, the fp32 output sum, the block's output, its fp32 copy (unless fp32) and
    the merge's product; and the log-sum-exps."""
    o, kvp, lse = _ring_units(c)
    o32 = 4 * o // c.e
    cast = o32 if c.e != 4 else 0  # (fp32: .float() is the tensor itself)
    first = 2 * kvp + o + cast
    later = kvp * (1 + int(c.degree > 2)) + o + cast + 2 * o32
    return max(first, later) + 2 * lse


def ring_backward_crest(c: Spec) -> int:
    """A head group's ring attention backward at its crest: the K/V pair in use and (D > 2)
    the next in flight, the fp32 dK/dV sum going out and the one arriving, the fp32 dQ sum, and
    one block's gradients (dQ of every query over a previous rank's first chunk, or of the
    second chunk over both: the larger)."""
    o, kvp, _ = _ring_units(c)
    block = max(o + kvp // 2, o // 2 + kvp)
    return kvp * (1 + int(c.degree > 2)) + 2 * kvp * FP32 // c.e + o * FP32 // c.e + block


def mlp_t(c: Spec, mlp: ModelConfig | None = None) -> int:
    """The MLP backward's crest beyond dX and dY: [t, f/D] buffers and slice-sized ones (a
    weight slice or a packed slice gradient, 3 f h e / D), on rank 0.

    The SiLU backward of a slice holds five [t, f/D] buffers (dG, silu(h1), h3 silu'(h1) and
    their concatenation [dh1 dh3], two wide), then three ([dh1 dh3] and the gate) while the
    gradient GEMMs write the packed slice gradient. Ring: the slice in use and the one arriving,
    and three accumulators taking turns (the one to compute into, the one arriving, the one
    leaving): min(D + 1, 5) slices. Broadcast: the slice in use and the next in flight, the
    previous gradient still reducing and the owner's own kept until the end: min(D, 4) slices,
    and one more, the gradient being written. At D = 1 only that gradient.
    """
    cfg, e, t, D = mlp or c.cfg, c.e, c.tokens, c.degree
    fl = cfg.ffn // D
    tf, sl = t * fl * e, mlp_slice_numel(cfg, D) * e
    if D == 1:
        return max(5 * tf, 3 * tf + sl)
    if c.options["mlp_schedule"] == "ring":
        return 5 * tf + min(D + 1, 5) * sl
    n = min(D, 4)
    return max(5 * tf + n * sl, 3 * tf + (n + 1) * sl)


class TSPCosts(costs.Costs):
    """The functions above behind the costs interface."""

    loss_head_passes = 4  # the loss recomputes its logits shard by shard in backward
    recompute_skips_w2 = True  # the MLP's recomputed forward skips its gate and W2 (mlp.py)

    def tensor_degree(self, layout: Layout) -> int:
        return 1  # each GEMM runs on a whole weight shard (a head group, an MLP slice)

    def weight_split(self, layout: Layout) -> int:
        return layout.degree  # every weight is 1/D per rank; each GEMM runs on whole weights

    def param_numel(self, cfg: ModelConfig, layout: Layout) -> int:
        return param_numel(cfg, layout.degree)

    def schedule(self, spec: Spec) -> Schedule:
        return schedule(spec)

    def saved_per_layer(self, spec: Spec) -> int:
        return saved_per_layer(spec)

    def saved_loss(self, spec: Spec) -> int:
        return saved_loss(spec)

    def inference_working_set(self, spec: Spec) -> tuple[int, int]:
        return inference_working_set(spec)

    def backward_transients(self, spec: Spec) -> tuple[int, int, int]:
        return backward_transients(spec)

    def metric_reductions(self, layout: Layout, train: bool) -> tuple[int, int]:
        return layout.degree, layout.degree if train else 1  # tokens and weights split D ways

    def experts_meet(self, spec: Spec) -> str:
        return _how(spec)
