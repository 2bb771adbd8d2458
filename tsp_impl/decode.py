"""TSP decode (``docs/decode.md`` section 2): weights stay with their owners, the KV cache is
split by sequence over the same D ranks (all heads of a rank's tokens), activations move.

Prefill runs the training forward (broadcast attention, ring or broadcast MLP) and keeps, for
every head group, the K/V of the rank's own zigzag tokens: all heads of its P/D prompt tokens.
Per decode step and layer, with the new token's hidden state on every rank:

    Q_r, K_r, V_r = owner r's heads of the new token          # rank r: head group r
    Q, K, V = all_gather                                      # all heads, every rank
    the owner of position pos (pos mod D) appends K, V        # round-robin: balanced
    o_p, lse_p = attention of Q over the local cache slice    # split-K, all heads
    o_r = merge on head owners: max all-reduce, reduce-scatter of [w o, w]
    x += all_reduce(o_r Wo_r^T); x += all_reduce(MLP slice r)  # row-parallel outputs

The embedding and head are the vocabulary shards (masked lookup and all-reduce; greedy arg max
by an all-gather of [value, index]): no weight moves per token.
"""

from __future__ import annotations

import torch

from tsp_impl import costs
from tsp_impl.attention import attention_forward, bias_rows
from tsp_impl.mlp import BroadcastMLP, RingMLP
from tsp_impl.mlp import biases as mlp_biases
from tsp_impl.plan import TSPPlan
from tsp_impl.vocab import VocabEmbedding
from tspbench.core import zigzag
from tspbench.core.collectives import reduce_from
from tspbench.core.comm import Comm
from tspbench.core.config import ModelConfig
from tspbench.core.costs import Schedule, Spec
from tspbench.core.decode import (
    FP32,
    PHASE,
    DecodeHooks,
    Decoder,
    greedy,
    greedy_events,
    last_token_events,
    run_layers,
)
from tspbench.core.kvcache import KVCache, Step, merge_scatter, partial_attention
from tspbench.core.layers import rms_norm
from tspbench.core.mesh import Axis
from tspbench.core.reference import QK_NORMS
from tspbench.core.vocab_parallel import embedding

MLP = {"ring": RingMLP, "broadcast": BroadcastMLP}


def attention_into_cache(
    x: torch.Tensor,
    w_own: torch.Tensor,
    plan: TSPPlan,
    cache: KVCache,
    layer: int,
    lp_norms: dict[str, torch.Tensor],
) -> torch.Tensor:
    """The broadcast-schedule attention forward (:func:`tsp_impl.attention.attention_forward`,
    nothing saved, no residual), keeping each head group's local K/V in the cache (heads of
    group r at [r hkv, (r+1) hkv)); ``lp_norms``: the layer's QK norms, if it has them."""
    n = x.shape[1]

    def keep(r: int, k: torch.Tensor, v: torch.Tensor) -> None:
        group = slice(r * plan.hkv, (r + 1) * plan.hkv)
        cache.k[layer][:, group, :n] = k
        cache.v[layer][:, group, :n] = v

    norms = (lp_norms["q_norm"], lp_norms["k_norm"]) if lp_norms else None
    return attention_forward(None, x, w_own, plan, False, keep, norms)[0]


def attend(cache: KVCache, comm: Comm):
    """``attend`` of :class:`DecodeHooks`: gather the new token's q/k/v of every head group,
    append K/V on the round-robin owner, split-K over the local slice, merge on head owners."""

    def run(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, hq, d = q.shape
        hkv = k.shape[1]
        every = comm.all_gather(torch.cat([q, k, v], dim=1)[None], dim=0)  # [D, B, hq+2hkv, d]
        every = every.transpose(0, 1)  # head group r's heads come r-th

        def heads(lo: int, n: int) -> torch.Tensor:
            return every[:, :, lo : lo + n].reshape(B, -1, d)

        if cache.mine:
            cache.write(i, heads(hq, hkv), heads(hq + hkv, hkv))
        return merge_scatter(*partial_attention(heads(0, hq), *cache.view(i)), comm)

    return run


def layer_views(lp: dict, cfg: ModelConfig, D: int) -> dict[str, torch.Tensor]:
    """A layer's own head group and MLP slice as reference-named (sharded) weights."""
    d = cfg.d_head
    hq, hkv = cfg.heads // D * d, cfg.kv_heads // D * d
    wq, wk, wv, wo_t, rest = lp["attn"].split([hq, hkv, hkv, hq, bias_rows(cfg, D)])
    biases = {}
    if cfg.qkv_bias:
        bq, bk, bv = rest.flatten()[: hq + 2 * hkv].split([hq, hkv, hkv])
        biases = {"bq": bq, "bk": bk, "bv": bv}
    fd = cfg.ffn // D
    w1, w3, w2t = lp["mlp"][: 3 * fd].chunk(3)
    if cfg.mlp_bias:  # the slice's [b1; b3] rows (Llama's mlp_bias)
        biases.update(zip(("b1", "b3"), mlp_biases(lp["mlp"], fd).split(fd)))
    return {
        "attn_norm": lp["attn_norm"], "wq": wq, "wk": wk, "wv": wv, "wo": wo_t.T,
        "mlp_norm": lp["mlp_norm"], "w1": w1, "w3": w3, "w2": w2t.T,
        **{k: lp[k] for k in (*QK_NORMS, "bo", "b2") if k in lp}, **biases,
    }  # fmt: skip


class TSPDecoder(Decoder):
    """TSP's decode path, on a :class:`tsp_impl.model.TSP` (``self.model``)."""

    @classmethod
    def validate(cls, strategy, cfg, layout, prompt_len, new_tokens, batch, **options) -> None:
        super().validate(strategy, cfg, layout, prompt_len, new_tokens, batch)
        strategy.validate(cfg, layout, prompt_len, batch, **options)

    @classmethod
    def cache_split(cls, layout) -> tuple[int, int]:
        return layout.degree, 1  # by sequence over D, every head

    @classmethod
    def schedule(cls, spec: Spec) -> Schedule:
        """Embedding all-reduce; per layer the q/k/v all-gather, the merge's max all-reduce and
        reduce-scatter, two all-reduces of [B, h]; the greedy all-gather (docs/decode.md s. 3)."""
        cfg, B, e, D = spec.cfg, spec.batch, spec.e, spec.degree
        h, kv, nh, d = cfg.hidden, cfg.kv_dim, cfg.heads, cfg.d_head
        ev, ax = Schedule(), Axis.MODEL
        ev.add(PHASE, ax, "all_reduce", D, B * h * e)
        for _ in range(cfg.layers):
            ev.add(PHASE, ax, "all_gather", D, B * (cfg.q_dim + 2 * kv) * e)
            ev.add(PHASE, ax, "all_reduce", D, B * nh * FP32)
            ev.add(PHASE, ax, "reduce_scatter", D, B * nh * (d + 1) * FP32)
            ev.add(PHASE, ax, "all_reduce", D, B * h * e, times=2)
        greedy_events(ev, spec, D, ax)
        return ev

    @classmethod
    def prefill_schedule(cls, spec: Spec) -> Schedule:
        ev = costs.schedule(spec, loss=False)
        last_token_events(ev, spec, spec.degree, Axis.MODEL)
        greedy_events(ev, spec, spec.degree, Axis.MODEL, "forward")
        return ev

    def _step(self, x: torch.Tensor) -> Step:
        m = self.model
        h = rms_norm(x, m.norms[0], m.cfg.norm_eps)
        return greedy((h @ m.tables[-1].T).float(), m.comm)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, max_len: int) -> tuple[KVCache, Step]:
        m = self.model
        cfg, comm, eps = m.cfg, m.comm, m.cfg.norm_eps
        D, r, (B, P) = comm.size, comm.rank, tokens.shape
        local = zigzag.shard(tokens, D, r).to(m.device)
        plan = m.plan(P)
        x = VocabEmbedding.apply(local, m.tables[0], comm, m.overlap)
        slots = KVCache.capacity(P, max_len, D)
        cache = KVCache.empty(cfg.layers, B, cfg.kv_heads, slots, cfg.d_head, x, D, r)
        mlp = MLP[m.mlp_schedule]
        for i, lp in enumerate(m.layers):
            x = x + attention_into_cache(
                rms_norm(x, lp["attn_norm"], eps), lp["attn"], plan, cache, i,
                {k: lp[k] for k in QK_NORMS if k in lp},
            )  # fmt: skip
            if "bo" in lp:
                x = x + lp["bo"]
            x = mlp.apply(
                x, rms_norm(x, lp["mlp_norm"], eps), lp["mlp"], comm, m.overlap, False, False,
                cfg.mlp_bias,
            )  # fmt: skip
            if "b2" in lp:
                x = x + lp["b2"]
        cache.start(P // D, P)
        last = x[:, -1].contiguous()  # position P-1 ends chunk 2D-1: rank 0's last local token
        return cache, self._step(comm.broadcast(last, src=0))

    @torch.no_grad()
    def decode_step(self, cache: KVCache, tokens: torch.Tensor) -> Step:
        m = self.model
        cfg, comm = m.cfg, m.comm
        x = embedding(tokens.to(m.device), m.tables[0], comm)
        layers = [layer_views(lp, cfg, comm.size) for lp in m.layers]
        hooks = DecodeHooks(attend(cache, comm), exit=lambda t: reduce_from(t, comm))
        return self._step(run_layers(cfg, layers, x, cache, hooks))
