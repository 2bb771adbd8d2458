"""Decode at paper scale without the hardware (``docs/decode.md``): bytes per generated token,
KV-cache and peak memory per rank, and a roofline time per token on a hardware preset.

Bytes are the strategy's own decode schedule (its decoder's ``schedule``, the closed form the tests
check against the counter); the cache is ``kv_cache_bytes``. Time per decode step: the larger of
reading this rank's weights and its cache once from memory and its FLOPs, plus every
collective of the step on the critical path (latency + bus bytes over the link: decode's
collectives wait on the step's own results, nothing hides them). Kernel launch overhead is not
modelled (decode loops are run under CUDA graphs in practice). The prefill is ``project`` of the
same run as one forward pass.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tspbench.core.decode import Decoder, bytes_per_step, kv_heads_local
from tspbench.projection import analytic
from tspbench.projection.costmodel import (
    call_time,
    group_link,
    project,
    rates,
    usable_memory,
)
from tspbench.runtime.spec import RunSpec

FP32 = 4


def _decoder(c: RunSpec) -> type[Decoder]:
    """The run's decode path (RunSpec refused a strategy without one before this is asked)."""
    assert c.impl.decoder is not None, f"{c.strategy}: no decode path"
    return c.impl.decoder


def bytes_per_token(c: RunSpec) -> dict[str, float]:
    """Per-rank bytes of one decode step by collective kind."""
    return bytes_per_step(_decoder(c).schedule(c))


def prefill_bytes(c: RunSpec) -> dict[str, float]:
    """Per-rank bytes of the prefill by collective kind (the record's ``prefill_comm_bytes``
    is their sum)."""
    return bytes_per_step(_decoder(c).prefill_schedule(prefill_spec(c)))


def _split(c: RunSpec) -> tuple[int, int, int]:
    """(ranks splitting the sequence, KV heads per rank, query heads per rank)."""
    seq, heads = _decoder(c).cache_split(c.layout)
    q_heads = c.cfg.heads // c.impl.costs.tensor_degree(c.layout)  # TSP, SP: every head (split-K)
    return seq, kv_heads_local(c.cfg.kv_heads, heads), q_heads


def prefill_spec(c: RunSpec) -> RunSpec:
    """The prefill as one forward pass (``--mode infer``). Where KV heads are replicated
    (n_kv < T) each rank holds one, as in a model of T KV heads: the same shapes per rank."""
    T = c.impl.costs.tensor_degree(c.layout)
    cfg = c.cfg if c.cfg.kv_heads >= T else dataclasses.replace(c.cfg, kv_heads=T)
    return c.replace(mode="infer", new_tokens=0, cfg=cfg)


def memory(c: RunSpec) -> dict[str, Any]:
    """Bytes per rank: weights, the cache, the prefill's peak (a forward pass with the cache
    alive, whose LM head sees the last position only: no loss over every token's logits) and
    the decode step's (scores and probabilities of every local key, fp32; logits), and the
    larger of the two."""
    kv = _decoder(c).kv_cache_bytes(c)
    prefill = analytic.memory(prefill_spec(c), loss=False)["peak"] + kv
    seq, _, q_heads = _split(c)
    slots = c.seq_len // seq + -(-(c.new_tokens - 1) // seq)
    vocab = c.cfg.vocab // c.impl.costs.weight_split(c.layout)
    weights = analytic.param_numel(c) * c.e
    step = weights + kv + 2 * FP32 * c.batch * q_heads * slots + 2 * FP32 * c.batch * vocab
    return {
        "weights": weights,
        "kv_cache_bytes": kv,
        "prefill_peak": prefill,
        "decode_peak": step,
        "peak": max(prefill, step),
        "peak_at": "prefill" if prefill >= step else "decode",
    }


def project_decode(c: RunSpec, preset: dict, prefill_ops: int | None = None) -> dict[str, Any]:
    """Projected prefill time, decode latency per token and its parts for one rank of ``c``;
    ``prefill_ops``: the prefill's dispatched operations (default: counted on fake tensors)."""
    per_node = preset.get("gpus_per_node", 8)
    r = rates(preset, min(c.degree, per_node))
    cfg, B, e = c.cfg, c.batch, c.e
    seq, kv_heads, q_heads = _split(c)
    slots = c.seq_len // seq + (c.new_tokens - 1) / 2 / seq  # the cache's mean length
    weights = analytic.param_numel(c) * e
    cache_read = 2 * cfg.layers * B * slots * kv_heads * cfg.d_head * e
    memory_s = (weights + cache_read) / r["memory_bandwidth"]
    attn = 4 * B * q_heads * slots * cfg.d_head * cfg.layers
    compute_s = 2 * B * analytic.param_numel(c) / r["gemm_flops"] + attn / r["attention_flops"]
    comm = 0.0
    for _, axis, kind, size, nbytes in _decoder(c).schedule(c):
        if size <= 1:
            continue
        comm += call_time(group_link(c, r, axis, kind, size, per_node), kind, nbytes, size)
    latency = max(memory_s, compute_s) + comm
    prefill = project(prefill_spec(c), preset, ops=prefill_ops, prefill=True)["step_time_s"]
    mem = memory(c)
    return {
        "prefill_time_s": prefill,
        "decode_latency_s": latency,
        "decode_tokens_per_s": B / latency,
        "generate_time_s": prefill + (c.new_tokens - 1) * latency,
        "decode_memory_s": memory_s,
        "decode_compute_s": compute_s,
        "decode_comm_s": comm,
        "decode_bytes_per_token": sum(bytes_per_token(c).values()),
        "kv_cache_bytes": mem["kv_cache_bytes"],
        "peak_mem_bytes": mem["peak"],
        "peak_at": mem["peak_at"],
        "fits": mem["peak"] <= usable_memory(preset),
    }
