"""Decode tables (modes ``decode`` and ``generate``, docs/decode.md) from the aggregate table.

Against the prompt length: the KV cache per rank (what sequence sharding saves), the peak memory
per rank (the cache included), the decode latency per token and the bytes each rank moves per
decode step. Against the batch: decode tokens/s. Rows are strategies (TSP first); a group holds
one degree D and its single-device reference (``single``, D = 1) beside it, at one value of
everything else (batch or prompt length, new tokens, mode). Every decode cell counts once,
whichever sweeps list it; a group needs two values of its axis to make a table.
"""

from __future__ import annotations

from collections.abc import Iterator

import pandas as pd

from tspbench.pipeline.labels import pivot
from tspbench.runtime.spec import DECODE_MODES

__all__ = ["decode_groups", "decode_specs", "decoding", "kv_unit"]
AXES = {"seq_len": ("batch", "new_tokens"), "batch": ("seq_len", "new_tokens")}
TAGS = {"mode": "", "degree": "D", "batch": "B", "seq_len": "S", "new_tokens": "N"}


def decoding(df: pd.DataFrame) -> pd.DataFrame:
    """The decode cells, each once (a cell of two sweeps appears once)."""
    if "mode" not in df or df.empty:
        return df.iloc[0:0]
    part = df[df["mode"].isin(DECODE_MODES)]
    return part.drop_duplicates("cell") if "cell" in part else part


def describe(key: dict) -> str:
    """``D = 2, B = 1, 8 new tokens, --mode decode`` for a group's fixed values."""
    out = [f"D = {key['degree']}"]
    if "batch" in key:
        out.append(f"B = {key['batch']}")
    if "seq_len" in key:
        out.append(f"prompt {key['seq_len']}")
    out.append(f"{key['new_tokens']} new tokens, --mode {key['mode']}")
    return ", ".join(out)


def decode_groups(df: pd.DataFrame, x: str) -> Iterator[tuple[str, dict, pd.DataFrame]]:
    """(name suffix, fixed values, rows) of every decode group along ``x`` (``seq_len`` or
    ``batch``) with at least two values of ``x``; the suffix names only what differs between
    the groups (``_B4``), so the usual single group keeps a short name."""
    d = decoding(df)
    if d.empty:
        return
    d = d.assign(new_tokens=d["new_tokens"].astype(int))
    sharded = sorted(int(v) for v in d["degree"].unique() if v > 1) or [1]
    found = []
    for D in sharded:
        part = d[d["degree"].isin({1, D})]  # the single-device reference beside every D
        keys = ["mode", *AXES[x]]
        for values, g in part.groupby(keys, sort=True):
            if g[x].nunique() >= 2 and (g["degree"] == D).any():
                found.append(({"degree": D, **dict(zip(keys, values))}, g))
    varying = [k for k in TAGS if len({str(key.get(k)) for key, _ in found}) > 1]
    for key, g in found:
        tag = "".join(f"_{TAGS[k]}{key[k]}" for k in varying)
        yield tag, key, g


def kv_unit(values: pd.Series) -> tuple[str, float, str]:
    """(unit, bytes per unit, format) that shows cache sizes from tiny to paper scale."""
    top = pd.to_numeric(values, errors="coerce").max()
    if top >= 10 * 2**30:
        return "GiB", 2**30, "{:.2f}"
    if top >= 10 * 2**20:
        return "MiB", 2**20, "{:.1f}"
    return "KiB", 2**10, "{:.0f}"


def decode_specs(df: pd.DataFrame, one: str, unit: str, scale: float) -> list[tuple]:
    """(name, caption, table) of every decode table the data supports (``one``: GPU or CPU
    rank; ``unit``, ``scale``: the peak-memory unit of the other tables)."""
    d = decoding(df)
    if d.empty or "kv_cache_bytes" not in d:
        return []
    kv_name, kv_scale, kv_fmt = kv_unit(d["kv_cache_bytes"])
    out = []
    for tag, key, g in decode_groups(d, "seq_len"):
        what = describe(key)
        g = g.assign(
            kv=g["kv_cache_bytes"] / kv_scale,
            peak=g["peak_mem_bytes"] / scale,
            ms=g["decode_latency_s"] * 1e3,
            kb=g["decode_bytes_per_token"] / 1e3,
        )
        out += [
            (
                f"kv_cache_vs_seq{tag}",
                f"KV cache per {one} ({kv_name}) vs prompt length, {what}",
                pivot(g, "label", "seq_len", "kv", kv_fmt),
            ),
            (
                f"decode_memory_vs_seq{tag}",
                f"Peak memory per {one} ({unit}, KV cache included) vs prompt length, {what}",
                pivot(g, "label", "seq_len", "peak", "{:.2f}"),
            ),
            (
                f"decode_latency_vs_seq{tag}",
                f"Decode latency per token (ms, median over the timed steps) vs prompt length, "
                f"{what}",
                pivot(g, "label", "seq_len", "ms", "{:.2f}"),
            ),
            (
                f"decode_bytes_vs_seq{tag}",
                f"Bytes communicated per {one} per decode step (kB; one token per sequence) vs "
                f"prompt length, {what}",
                pivot(g, "label", "seq_len", "kb", "{:.1f}"),
            ),
        ]
    for tag, key, g in decode_groups(d, "batch"):
        out.append(
            (
                f"decode_throughput_vs_batch{tag}",
                f"Decode throughput (tokens/s: batch / latency per token) vs batch, "
                f"{describe(key)}",
                pivot(g, "label", "batch", "decode_tokens_per_s", "{:.0f}"),
            )
        )
    return out
