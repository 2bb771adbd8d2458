"""TSP's closed forms per rank: its parameters, its schedule of collectives, its memory.

What :class:`tsp_impl.model.TSP` answers when the analytic and cost models ask (the methods of
:class:`tspbench.core.strategy.Strategy`), written next to the schedules they count: the
broadcast attention (attention.py), the ring or broadcast MLP (mlp.py, ``mlp_schedule``) and the
vocabulary-parallel embedding and loss (vocab.py). docs/method.md section 6 (communication) and
section 7 (memory).

Notation (docs/method.md section 1): B micro-batch, S sequence, h hidden, kv = n_kv*d, f MLP size,
V vocabulary, L layers, e bytes per element, D the degree; t = tokens on this rank.
"""

from __future__ import annotations

from tspbench.core import costs
from tspbench.core.config import ModelConfig
from tspbench.core.costs import Schedule, Spec
from tspbench.core.mesh import Axis


def param_numel(cfg: ModelConfig, D: int) -> int:
    """Every weight but the norms is 1/D per rank: head group, MLP slice, vocabulary rows."""
    return costs.split_numel(cfg, D)


def largest_param(cfg: ModelConfig, D: int) -> int:
    """The largest packed shard: vocabulary rows, the MLP slice or the head group."""
    h, kv, f, V = cfg.hidden, cfg.kv_dim, cfg.ffn, cfg.vocab
    return max(V * h, 3 * f * h, (2 * h + 2 * kv) * h) // D


def schedule(c: Spec) -> Schedule:
    """Every shard of every weight is broadcast by its owner (attention, embedding, LM head; the
    MLP's with ``mlp_schedule = broadcast``) or passed around the ring (the MLP's); one head
    group's K/V are all-gathered along the sequence. In backward the weights come again, and
    their gradients are reduced to their owners (the ring's accumulators travel behind them).

    Overlapped (``ov``: with ``overlap`` on), as the code does it (tsp_impl/overlap.py, mlp.py):
    each broadcast loop prefetches shard r+1 while shard r computes (its first broadcast is
    waited for at once); every ring hop is in flight during a step's GEMMs but the backward's
    last accumulator hop; a weight-gradient reduce drains while the next gradient computes (its
    last is waited for at once; attention's and the vocabulary's even with overlap off). K/V
    gathers, their reduce-scatters and the norms' all-reduce are blocking."""
    cfg, B, S, e, D = c.cfg, c.batch, c.seq_len, c.e, c.degree
    h, kv, f, V, L = cfg.hidden, cfg.kv_dim, cfg.ffn, cfg.vocab, cfg.layers
    wa, wm, wv = (2 * h + 2 * kv) * h // D * e, 3 * f * h // D * e, V // D * h * e
    kv_full = 2 * B * S * kv // D * e  # one head group's K and V over the whole sequence
    ev, M = Schedule(), Axis.MODEL
    ring, ov = c.mlp_schedule == "ring", c.overlap

    def layer_fwd(phase: str) -> None:
        ev.add(phase, M, "broadcast", D, wa, D, overlapped=ov, exposed=1)
        ev.add(phase, M, "all_gather", D, kv_full, D)
        if ring:
            ev.add(phase, M, "send_recv", D, wm, D - 1, overlapped=ov)
        else:
            ev.add(phase, M, "broadcast", D, wm, D, overlapped=ov, exposed=1)

    ev.add("forward", M, "broadcast", D, wv, D, overlapped=ov, exposed=1)  # embedding shards
    for _ in range(L):
        layer_fwd("forward")
    ev.add("forward", M, "broadcast", D, wv, D, overlapped=ov, exposed=1)  # LM head shards
    if c.train:
        ev.add("backward", M, "broadcast", D, wv, D, overlapped=ov, exposed=1)
        ev.add("backward", M, "reduce", D, wv, D, overlapped=True, exposed=1)
        for _ in range(L):
            if c.rc:
                layer_fwd("backward")
            ev.add("backward", M, "broadcast", D, wa, D, overlapped=ov, exposed=1)
            ev.add("backward", M, "all_gather", D, kv_full, D)
            ev.add("backward", M, "reduce_scatter", D, kv_full, D)
            ev.add("backward", M, "reduce", D, wa, D, overlapped=True, exposed=1)
            if ring:  # D-1 slice hops, D accumulator hops
                ev.add("backward", M, "send_recv", D, wm, 2 * D - 1, overlapped=ov, exposed=1)
            else:
                ev.add("backward", M, "broadcast", D, wm, D, overlapped=ov, exposed=1)
                ev.add("backward", M, "reduce", D, wm, D, overlapped=ov, exposed=1)
        # embedding grad, owner by owner
        ev.add("backward", M, "reduce", D, wv, D, overlapped=True, exposed=1)
        ev.add("backward", M, "all_reduce", D, costs.norm_numel(cfg) * e)  # norm grads
    return ev


def saved_per_layer(c: Spec) -> int:
    """Bytes one layer keeps for backward: the norms' and, per head group, local Q, K_p, V_p, A,
    lse; per MLP slice h1, h3."""
    cfg, e, t = c.cfg, c.e, c.tokens
    h, kv, f = cfg.hidden, cfg.kv_dim, cfg.ffn
    return costs.norms_saved(c) + (2 * t * h + 2 * t * kv + 2 * t * f) * e + 4 * t * cfg.heads


def saved_loss(c: Spec) -> int:
    """The final norm's, and the online log-sum-exp: the logits are recomputed."""
    return costs.final_norm_saved(c) + 4 * c.tokens


def _units(c: Spec) -> tuple[int, int, int]:
    """(one [t, h] activation, one gathered K/V pair of a head group, one shard's fp32 logits)."""
    cfg, D = c.cfg, c.degree
    act = c.tokens * cfg.hidden * c.e
    return act, costs.kv_unit(c, cfg.kv_dim // D), 4 * c.tokens * (cfg.vocab // D)


def inference_working_set(c: Spec) -> tuple[int, int]:
    """(layer, loss): x, normed x, Y; this and the previous attention shard (and its Q, K, V, A:
    loop locals); the K/V gather stages three copies of a head group's K/V (stacked, gathered,
    reordered). The loss: a shard's logits, three copies, and the head shard in use and in
    flight."""
    cfg, e, t, D = c.cfg, c.e, c.tokens, c.degree
    h, kv, vl = cfg.hidden, cfg.kv_dim, cfg.vocab // D
    act, kv_unit, logits = _units(c)
    wa = (2 * h + 2 * kv) * h // D * e
    layer = 3 * act + 2 * wa + t * (3 * h + 4 * kv) // D * e
    if D > 1:
        layer += 3 * kv_unit + 2 * t * kv // D * e
    return layer, 2 * act + 3 * logits + 2 * vl * h * e


def backward_transients(c: Spec) -> tuple[int, int, int]:
    """At the loss: one vocabulary shard's recomputed logits, three copies, and the head shard
    and its gradient in flight; at a layer: four copies of one head group's K/V over the sequence
    (the gather and its gradient staging, 3.5 pairs), or the MLP's SiLU backward with its slices
    in flight (:func:`mlp_t`); at the end: the embedding gradient, one owner's [V/D, h] filling
    and one in flight, and a masked copy of dx."""
    cfg, e, D = c.cfg, c.e, c.degree
    h, vl = cfg.hidden, cfg.vocab // D
    act, kv_unit, logits = _units(c)
    loss_t = 3 * logits + act + 2 * vl * h * e
    layer_t = 2 * act + max(7 * kv_unit // 2, mlp_t(c))
    return loss_t, layer_t, 2 * vl * h * e + act


def mlp_t(c: Spec) -> int:
    """The MLP backward's crest beyond dX and dY: [t, f/D] buffers and slice-sized ones (a
    weight slice or a packed slice gradient, 3 f h e / D).

    Ring: six [t, f/D] buffers (the previous step's are freed only as the next step's replace
    them) and five slices: the one in use and the one arriving, the accumulator being computed,
    the one arriving and the one leaving. Broadcast: the SiLU backward of one slice, whose
    buffers are freed before the next (six [t, f/D] while forming dh1: silu(h1), dG, dG * h3
    and silu'(h1)'s three temporaries; four with the gradient's two slices: its three parts and
    their concatenation), with the slice in use and the next in flight (two slices alive), the
    previous gradient still reducing, and the owner's own gradient kept until the end: at most
    six slices in all (rank 0 from D = 4 on; D + 2 below).
    """
    cfg, e, t, D = c.cfg, c.e, c.tokens, c.degree
    fl = cfg.ffn // D
    tf, sl = t * fl * e, 3 * fl * cfg.hidden * e
    if c.mlp_schedule == "ring":
        return 6 * tf + 5 * sl
    n = min(D + 2, 6)
    return max(6 * tf + (n - 2) * sl, 4 * tf + n * sl)
