"""Closed-form cost of one step per rank: bytes by collective and phase, FLOPs, memory by part.

Each strategy's schedule is written out as the list of collectives it issues (docs/method.md
section 6, extended to backward, recomputation, embeddings and the loss), and bytes are counted
with the same :func:`bus_bytes` rule as the measured counter, so the two must agree exactly;
tests assert it. FLOPs are what torch's FlopCounterMode counts: matmuls (2mnk) and the attention
kernel's formula (4 b h s_q s_k d forward, 2.5 times that backward), with the kernel's blocks as
the implementation calls them. Memory is model state plus saved activations plus the largest
transient, per part; see :func:`memory`.

Notation (docs/method.md section 1): B micro-batch, S sequence, h hidden, kv = n_kv*d, f MLP size,
V vocabulary, L layers, e bytes per element; t = tokens on this rank.
"""

from __future__ import annotations

from collections import defaultdict

from tspbench.core.comm import KINDS, bus_bytes
from tspbench.core.config import ModelConfig
from tspbench.runtime.spec import RunSpec

KINDS_COLLECTIVE = tuple(k for k in KINDS if k != "send_recv")  # group-wide, not point-to-point
FP32 = 4


# -- parameters -------------------------------------------------------------------------------
def layer_numel(cfg: ModelConfig) -> int:
    h, kv, f = cfg.hidden, cfg.kv_dim, cfg.ffn
    return 2 * h + 2 * h * h + 2 * h * kv + 3 * h * f


def param_numel(c: RunSpec) -> int:
    """Parameter elements held by one rank (what the optimizer steps)."""
    cfg, L, h, V = c.cfg, c.cfg.layers, c.cfg.hidden, c.cfg.vocab
    norms = (2 * L + 1) * h
    full = L * layer_numel(cfg) + 2 * V * h + h
    if c.strategy in ("dp", "single", "sp"):
        return full
    if c.strategy in ("tp", "tpsp", "tsp"):
        T = c.degree if c.strategy in ("tp", "tsp") else c.tp
        return (full - norms) // T + norms
    if c.strategy == "fsdp_cp":
        D = c.degree
        units = [V * h] + [layer_numel(cfg)] * L + [h + V * h]
        return sum(-(-u // D) for u in units)
    raise ValueError(f"unknown strategy {c.strategy!r}")


def largest_param(c: RunSpec) -> int:
    """Elements of the largest parameter tensor one rank holds (AdamW's temporaries)."""
    cfg, D = c.cfg, c.degree
    h, kv, f, V = cfg.hidden, cfg.kv_dim, cfg.ffn, cfg.vocab
    if c.strategy == "tsp":
        return max(V * h, 3 * f * h, (2 * h + 2 * kv) * h) // D
    if c.strategy == "fsdp_cp":
        return -(-max(V * h + h, layer_numel(cfg)) // D)
    T = {"tp": D, "tpsp": c.tp}.get(c.strategy, 1)
    return max(V * h, f * h) // T


# -- communication ----------------------------------------------------------------------------
Event = tuple[str, str, str, int, float]  # (phase, axis, kind, group size, full tensor bytes)


def schedule(c: RunSpec) -> list[Event]:
    """Every collective one rank issues in a step, with its phase, mesh axis and group size."""
    cfg, B, S, e = c.cfg, c.batch, c.seq_len, c.e
    h, kv, f, V, L = cfg.hidden, cfg.kv_dim, cfg.ffn, cfg.vocab, cfg.layers
    D, ev = c.degree, []

    def add(phase, axis, kind, size, nbytes, times=1):
        ev.extend([(phase, axis, kind, size, float(nbytes))] * times)

    phases = ("forward", "backward") if c.train else ("forward",)
    s = c.strategy
    if s == "tsp":
        wa, wm, wv = (2 * h + 2 * kv) * h // D * e, 3 * f * h // D * e, V // D * h * e
        kv_full = 2 * B * S * kv // D * e  # one head group's K and V over the whole sequence

        def layer_fwd(phase):
            add(phase, "model", "broadcast", D, wa, D)
            add(phase, "model", "all_gather", D, kv_full, D)
            add(phase, "model", "send_recv", D, wm, D - 1)

        add("forward", "model", "broadcast", D, wv, D)  # embedding shards
        for _ in range(L):
            layer_fwd("forward")
        add("forward", "model", "broadcast", D, wv, D)  # LM head shards
        if c.train:
            add("backward", "model", "broadcast", D, wv, D)
            add("backward", "model", "reduce", D, wv, D)
            for _ in range(L):
                if c.rc:
                    layer_fwd("backward")
                add("backward", "model", "broadcast", D, wa, D)
                add("backward", "model", "all_gather", D, kv_full, D)
                add("backward", "model", "reduce_scatter", D, kv_full, D)
                add("backward", "model", "reduce", D, wa, D)
                add("backward", "model", "send_recv", D, wm, 2 * D - 1)
            add("backward", "model", "reduce_scatter", D, V * h * e)  # embedding grad
            add("backward", "model", "all_reduce", D, (2 * L + 1) * h * e)  # norm grads
    elif s in ("tp", "tpsp"):
        T, Sg = (D, 1) if s == "tp" else (c.tp, c.sp)
        act = c.tokens * h * e
        add("forward", "tp" if s == "tpsp" else "model", "all_reduce", T, act)  # embedding
        ax = "tp" if s == "tpsp" else "model"
        kvb = 2 * B * S * kv // T * e
        for phase in phases:
            # forward: two row-parallel all-reduces per layer; backward: two copy_to all-reduces,
            # plus the recomputed forward, which stops after the last op that saves a tensor
            # (the W2 GEMM): so its last all-reduce is not repeated
            n = 2 * L if phase == "forward" else 2 * L + (L if c.rc else 0)
            add(phase, ax, "all_reduce", T, act, n)
            if s == "tpsp":
                n = L if phase == "forward" or c.rc else 0
                add(phase, "sp", "all_gather", Sg, kvb, n)
                if phase == "backward":
                    add(phase, "sp", "reduce_scatter", Sg, kvb, L)
        add("forward", ax, "all_reduce", T, c.tokens * FP32, 3)  # CE max, sum-exp, target
        if c.train:
            add("backward", ax, "all_reduce", T, act)  # copy_to before the LM head
            if s == "tpsp":
                add("backward", "sp", "all_reduce", Sg, param_numel(c) * e)
    elif s in ("sp", "fsdp_cp"):
        kvb = 2 * B * S * kv * e
        for phase in phases:
            add(phase, "model", "all_gather", D, kvb, L if phase == "forward" or c.rc else 0)
        if c.train:
            add("backward", "model", "reduce_scatter", D, kvb, L)
        if s == "sp" and c.train:
            add("backward", "model", "all_reduce", D, param_numel(c) * e)
        if s == "fsdp_cp":
            pad = lambda n: -(-n // D) * D  # noqa: E731
            u0, ul, un = pad(V * h) * e, pad(layer_numel(cfg)) * e, pad(h + V * h) * e
            add("forward", "model", "all_gather", D, u0)
            add("forward", "model", "all_gather", D, ul, L)
            add("forward", "model", "all_gather", D, un)
            if c.train:  # layers: regathered (or recomputed) in backward; embedding never
                add("backward", "model", "all_gather", D, ul, L)
                if not c.rc:  # under recompute the head unit keeps its gathered weights
                    add("backward", "model", "all_gather", D, un)
                add("backward", "model", "reduce_scatter", D, u0)
                add("backward", "model", "reduce_scatter", D, ul, L)
                add("backward", "model", "reduce_scatter", D, un)
    elif s == "dp":
        if c.train:
            add("backward", "model", "all_reduce", D, param_numel(c) * e)
    elif s != "single":
        raise ValueError(f"unknown strategy {s!r}")
    if c.train and c.dp > 1:
        add("dp", "dp", "all_reduce", c.dp, param_numel(c) * e)
    return ev


def comm_bytes(c: RunSpec) -> dict[tuple[str, str], float]:
    """Bytes one rank moves per step, by (phase, collective kind), the counter's convention."""
    out: dict[tuple[str, str], float] = defaultdict(float)
    for phase, _, kind, size, nbytes in schedule(c):
        if size > 1:
            out[(phase, kind)] += bus_bytes(kind, nbytes, size)
    return dict(out)


def comm_by_kind(c: RunSpec) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for (_, kind), b in comm_bytes(c).items():
        out[kind] += b
    return dict(out)


# -- FLOPs ------------------------------------------------------------------------------------
def attention_blocks(c: RunSpec) -> int:
    """Sum of s_q * s_k over the kernel calls of one sequence and head on this rank.

    One rank holds zigzag chunks r and 2P-1-r of size s = S/2P; chunk j is one call over its
    (j+1)s keys (the CPU kernel splits it into a prefix and a diagonal block: the same sum), so
    every rank has s^2 (2P+1). Without a split sequence (P = 1) the kernel sees S x S.
    """
    P, S = c.cp, c.seq_len
    if P == 1:
        return S * S
    s = S // (2 * P)
    return s * s * (2 * P + 1)


def flop_parts(c: RunSpec, executed: bool = False) -> dict[str, int]:
    """FLOPs one rank runs per step, GEMMs and attention apart, as FlopCounterMode counts them;
    ``executed``: attention as a causal kernel runs it (a diagonal block costs half)."""
    cfg, B = c.cfg, c.batch
    h, kv, f, V, L, d = cfg.hidden, cfg.kv_dim, cfg.ffn, cfg.vocab, cfg.layers, cfg.head_dim
    t, s = c.tokens, c.strategy
    T = {"tp": c.degree, "tpsp": c.tp}.get(s, 1)  # weight split of the GEMMs on a rank
    seqs = B // c.degree if s == "dp" else B
    gemm = 2 * t * (2 * h * h + 2 * h * kv + 3 * h * f) // T  # one layer, forward
    blocks = attention_blocks(c)
    if executed:  # each call's diagonal s_q x s_q block is half masked
        blocks -= (c.seq_len**2 // 2) if c.cp == 1 else (c.seq_len // (2 * c.cp)) ** 2
    attn = 4 * seqs * (cfg.heads // T) * d * blocks  # one layer, forward
    head = 2 * t * h * V // T
    if not c.train:
        return {"gemm": L * gemm + head, "attention": L * attn}
    # backward: GEMMs twice, attention 2.5x; TSP's loss recomputes its logits shard by shard
    g = L * 3 * gemm + (4 if s == "tsp" else 3) * head
    a = L * (attn + 5 * attn // 2)
    if c.rc:  # autograd's recompute stops after the last op that saves a tensor: TSP's custom
        # layers save at their very end; a plain autograd layer skips its final W2 GEMM
        g += L * (gemm - (0 if s == "tsp" else 2 * t * f * h // T))
        a += L * attn
    return {"gemm": g, "attention": a}


def flops(c: RunSpec) -> int:
    """FLOPs one rank executes per step, as FlopCounterMode counts them."""
    return sum(flop_parts(c).values())


def gemm_size(c: RunSpec) -> float:
    """Equivalent square size of the step's typical GEMM (tokens x hidden x per-rank width),
    the cube root of its m*n*k: what a GEMM rate table is looked up with."""
    T = {"tp": c.degree, "tpsp": c.tp, "tsp": c.degree}.get(c.strategy, 1)
    width = (c.cfg.hidden + c.cfg.ffn) / 2 / T  # projection and MLP widths, on one rank
    return (c.tokens * c.cfg.hidden * width) ** (1 / 3)


def elementwise_bytes(c: RunSpec) -> float:
    """Rough memory traffic of the non-GEMM work: every saved activation written and read once
    per pass (forward, backward, recompute), and AdamW's passes over weights, grads, moments."""
    act = c.cfg.layers * saved_per_layer(c) + saved_loss(c)
    if not c.train:
        return 2.0 * act
    passes = 6 if c.rc else 4
    return passes * act + 16 * 4 * param_numel(c)


# -- memory -----------------------------------------------------------------------------------
def _local_dims(c: RunSpec) -> tuple[int, int, int, int]:
    """(query heads, kv width, MLP width, vocabulary rows) of the weights one rank applies."""
    cfg = c.cfg
    T = {"tp": c.degree, "tpsp": c.tp}.get(c.strategy, 1)
    return cfg.heads // T, cfg.kv_dim // T, cfg.ffn // T, cfg.vocab // T


def saved_per_layer(c: RunSpec) -> int:
    """Bytes one layer keeps for backward (no recomputation), from what each op saves."""
    cfg, e, t, B, S = c.cfg, c.e, c.tokens, c.batch, c.seq_len
    h, d = cfg.hidden, cfg.head_dim
    rms = 2 * (8 * t * h + 4 * t)  # per RMSNorm: fp32 input, 1/rms, normalised (fp32)
    normed = 2 * t * h * e  # the two normed inputs the projections keep
    if c.strategy == "tsp":  # per head group: local Q, K_p, V_p, A, lse; per MLP slice h1, h3
        return (
            rms
            + normed
            + (2 * t * h + 2 * t * cfg.kv_dim + 2 * t * cfg.ffn) * e
            + 4 * t * cfg.heads
        )
    nh, kvl, fl, _ = _local_dims(c)
    kv = 2 * B * S * kvl * e if c.cp > 1 else 2 * t * kvl * e  # the gathered K/V, or local K/V
    o_copy = c.cp > 1  # zigzag chunks are concatenated, so merging heads copies
    attn = (2 + o_copy) * t * nh * d * e + 4 * t * nh + kv
    return rms + normed + attn + 4 * t * fl * e  # MLP: h1, silu(h1), h3, their product


def saved_loss(c: RunSpec) -> int:
    """Bytes the final norm and the loss keep for backward."""
    cfg, t = c.cfg, c.tokens
    h = cfg.hidden
    out = 8 * t * h + 4 * t + t * h * c.e  # final RMSNorm and its output
    _, _, _, vl = _local_dims(c)
    if c.strategy == "tsp":
        return out + 4 * t  # the online log-sum-exp; logits are recomputed
    if c.strategy in ("tp", "tpsp"):
        return out + 4 * t * vl + 13 * t  # exp(logits - max), sum, hit mask, index
    return out + 4 * t * vl  # log-softmax output


def memory(c: RunSpec) -> dict[str, float | str]:
    """Bytes per rank by part, and the peak of the first step and of the steady state.

    The peak is the largest of the moments where a step's memory crests, each a sum of parts:
      loss backward    saved activations + the loss's logit buffers (TSP: one vocabulary
                       shard's recomputed logits, three copies; others: three [t, V/T] fp32
                       copies, one of them saved)
      layer backward   saved activations + the top layer's backward: the attention's gathered
                       K/V and its gradient staging (TSP: four copies of one head group's K/V
                       over the sequence; context parallel: one and a half gathered K/V pairs),
                       or the MLP's SiLU backward (three [t, f/T] buffers; TSP: five, and the
                       slice and accumulator in flight)
      end of backward  all gradients + the gradient reduction's staging (TSP: the embedding
                       gradient's [V, h] buffer, twice; SP/DP/TP+SP: one packed copy)
      optimizer step   all gradients + AdamW moments (+ fp32 gradient copies for bf16 weights)
      inference        the layer's working set: a plain layer keeps its locals (normed input,
                       Q, K/V, attention output) alive while its MLP runs; TSP's gather stages
                       three copies of a head group's K/V; or the loss's logits
    Activations under recomputation: each layer keeps its input, and the top layer's saved
    tensors come back while its backward runs. The tests compare the result with measured and
    fake-tensor peaks.
    """
    cfg, e, t, B, S = c.cfg, c.e, c.tokens, c.batch, c.seq_len
    h, V, d, L = cfg.hidden, cfg.vocab, cfg.head_dim, cfg.layers
    n = param_numel(c)
    nh, kvl, fl, vl = _local_dims(c)
    tsp = c.strategy == "tsp"
    if tsp:
        kvl, fl, vl = cfg.kv_dim // c.degree, cfg.ffn // c.degree, V // c.degree
    kv_unit = 2 * (B * S if c.cp > 1 else t) * kvl * e  # one gathered (or local) K/V pair
    act = t * h * e  # one [t, h] activation
    weights, masters = n * e, (4 * n if c.train and e != 4 else 0)
    rest = weights + masters + 16 * t  # + int64 tokens and labels
    parts: dict[str, float | str] = {
        "weights": weights,
        "master_weights": masters,
        "grads": n * e if c.train else 0,
        "optimizer": 8 * n if c.train else 0,
    }
    logits = 4 * t * vl  # one fp32 [t, V/T] buffer
    if not c.train:
        if tsp:
            wa = (2 * h + 2 * cfg.kv_dim) * h // c.degree * e
            # x, normed x, Y; this and the previous shard (and its Q, K, V, A: loop locals)
            layer = 3 * act + 2 * wa + t * (3 * h + 4 * cfg.kv_dim) // c.degree * e
            if c.degree > 1:  # the K/V gather: stacked, gathered, reordered
                layer += 3 * kv_unit + 2 * t * cfg.kv_dim // c.degree * e
            loss = 2 * act + 3 * logits + 2 * vl * h * e  # + head shard in use and in flight
        else:
            attn_locals = 2 * act + 2 * t * nh * d * e + kv_unit + (c.cp > 1) * t * nh * d * e
            layer = attn_locals + 2 * act + 3 * t * fl * e  # + residual, normed, MLP crest
            if c.cp > 1:  # the K/V gather: local K/V, stacked, gathered, reordered
                layer = max(layer, 2 * act + t * nh * d * e + 4 * t * kvl * e + 2 * kv_unit)
            loss = 2 * act + (3 if c.strategy in ("tp", "tpsp") else 2) * logits
        if c.strategy == "fsdp_cp":  # the gathered unit in use
            layer += layer_numel(cfg) * e
            loss += (V * h + h) * e
        work = max(layer, loss)
        parts.update(saved_activations=0, transient=work, peak_at="inference")
        parts["peak_first"] = parts["peak"] = rest + work
        return parts
    per_layer, loss_saved = saved_per_layer(c), saved_loss(c)
    layers = L * act if c.rc else L * per_layer  # checkpointing keeps each layer's input
    head_grad = vl * h * e
    mlp_t = 3 * t * fl * e  # the SiLU backward's temporaries and the gate gradients
    if tsp:
        loss_t = 3 * logits + act + 2 * vl * h * e
        layer_t = 2 * act + max(7 * kv_unit // 2, 6 * t * fl * e + 5 * 3 * fl * h * e)
        end_t = 2 * V * h * e
    else:
        loss_t = 2 * logits
        layer_t = 2 * act + max(5 * kv_unit // 2 if c.cp > 1 else 0, mlp_t)
        end_t = n * e if c.strategy in ("sp", "dp", "tpsp") else 0
    top = per_layer if c.rc else 0  # the recomputed top layer's saved tensors
    crests = {
        "loss backward": rest + layers + loss_saved + loss_t + head_grad,
        "layer backward": rest + layers + top + layer_t + head_grad,
        "end of backward": rest + n * e + end_t,
    }
    # AdamW: moments, fp32 gradient copies for bf16 weights, three temporaries of the largest
    opt = rest + n * e + 8 * n + (4 * n if e != 4 else 0) + 3 * 4 * largest_param(c)
    at = max(crests, key=crests.get)
    parts.update(saved_activations=layers + loss_saved, transient=crests[at] - rest - layers)
    first = max(crests[at], opt)
    steady = max(crests[at] + 8 * n, opt)
    parts.update(peak_first=first, peak=steady, peak_at=at if steady > opt else "optimizer step")
    return parts
