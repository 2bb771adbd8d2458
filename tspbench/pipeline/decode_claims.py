"""The paper's inference claims (decode with a KV cache, docs/decode.md) against ours, for
``tspbench claims``: the KV cache per GPU against the single-device cache, and the longest
prompt each strategy can serve in a GPU's memory.

Projected numbers come from the closed forms (``kv_cache_bytes``, the analytic decode memory of
``tspbench.projection.decode``) at the claims' model, D and hardware: milliseconds, so the table
stays a matter of seconds without any fresh result. Measured numbers come from the decode cells
of the measured summary when it has any (``snakemake`` on the default config runs them); the
committed reference summary predates decode and says so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from tspbench.core.config import ConfigError, ModelConfig
from tspbench.core.strategy import Layout
from tspbench.pipeline.aggregate import per_sweep
from tspbench.pipeline.claim_checks import HOLDS, Row, Sources, _rel
from tspbench.pipeline.labels import REFERENCE, is_reference
from tspbench.projection.costmodel import load_preset, usable_memory
from tspbench.projection.decode import memory
from tspbench.runtime.registry import get_strategy
from tspbench.runtime.spec import DECODE_MODES, RunSpec

__all__ = ["kv_cache_rows", "longest_context_rows", "measured_decode"]
GiB = 2**30


def _spec(cfg: ModelConfig, strategy: str, layout, P: int, c: dict, batch: int = 1) -> RunSpec:
    return RunSpec(strategy=strategy, cfg=cfg, layout=layout, seq_len=P, batch=batch,
                   mode="decode", new_tokens=c.get("new_tokens", 128), dtype="bf16")  # fmt: skip


def _layouts(strategies: list[str], D: int) -> list[tuple[str, Layout]]:
    """(strategy, model group) at degree D (the single-device reference: one GPU whatever D;
    a factored strategy: each T x Sigma of D)."""
    out = []
    for s in strategies:
        factors = [[t, D // t] for t in range(2, D) if D % t == 0]
        out += [(s, lay) for lay in get_strategy(s).sweep_layouts([D], factors)]
    return out


def measured_decode(summary: Path) -> pd.DataFrame:
    """The ok decode cells of a measured summary (none: an empty frame)."""
    try:
        df = per_sweep(pd.read_csv(summary))
    except (OSError, ValueError):
        return pd.DataFrame()
    if "mode" not in df or "kv_cache_bytes" not in df:
        return pd.DataFrame()
    d = df[df["mode"].isin(DECODE_MODES) & (df["status"] == "ok")]
    return d.drop_duplicates("cell")


def _measured_ratios(d: pd.DataFrame, subject: str) -> tuple[list[tuple], str]:
    """(single / subject's cache, D) per (prompt, batch, new tokens, mode) measured with both,
    and whether every strategy generated single's tokens in those cells."""
    keys = ["seq_len", "batch", "new_tokens", "mode"]
    ratios: list[tuple] = []
    same = total = 0
    if d.empty:
        return ratios, ""
    for key, g in d.groupby(keys):
        is_ref = is_reference(g["strategy"])
        ref = g[is_ref]
        if ref.empty:
            continue
        for _, r in g[~is_ref].iterrows():
            if "generated_tokens" in g and pd.notna(r.get("generated_tokens")):
                total += 1
                same += json.loads(r["generated_tokens"]) == json.loads(
                    ref.iloc[0]["generated_tokens"]
                )
            if r["strategy"] == subject:
                ratio = ref.iloc[0]["kv_cache_bytes"] / r["kv_cache_bytes"]
                ratios.append((int(key[0]), int(r["degree"]), ratio))
    tokens = f"; generated tokens equal single's in {same}/{total} cells" if total else ""
    return ratios, tokens


def kv_cache_rows(c: dict, cfg: ModelConfig, src: Sources) -> list[Row]:
    """TSP's KV cache per GPU against the single-device cache (ideal: 1/D), projected at the
    claim's prompt lengths and measured where the summary has decode cells."""
    D, subject = int(c["degree"]), c["subject"]
    single, tsp = (_layouts([s], D)[0][1] for s in (REFERENCE, subject))
    proj = {P: memory(_spec(cfg, REFERENCE, single, P, c))["kv_cache_bytes"]
            / memory(_spec(cfg, subject, tsp, P, c))["kv_cache_bytes"]
            for P in c["seq_lens"]}  # fmt: skip
    ours = [f"projected ({cfg.name} bf16, D = {D}, batch 1): single / TSP = "
            + ", ".join(f"{v:.3f} at {P // 1024}K" for P, v in proj.items())]  # fmt: skip
    off = [abs(v / D - 1) for v in proj.values()]
    measured, tokens = _measured_ratios(measured_decode(src.measured), subject)
    if measured:
        ours.append("measured here: " + ", ".join(f"{r:.3f} at P = {P}, D = {d}"
                                                  for P, d, r in measured))  # fmt: skip
        off += [abs(r / d - 1) for _, d, r in measured]
        where = f"{_rel(src.measured)} (decode cells)"
    else:
        ours.append(f"measured: no decode cells in {_rel(src.measured)}")
        where = "tspbench/projection/decode.py"
    worst = max(off)
    return [
        Row(
            c["claim"],
            "KV cache split by sequence over the D GPUs (1/D per GPU)",
            "; ".join(ours),
            "holds" if worst <= HOLDS else "partly" if worst <= 2 * HOLDS else "differs",
            f"largest distance from 1/D: {worst:.1%}; each rank also holds its share of the "
            "generated tokens (new token i goes to rank i mod D), so the cache is P/D + "
            "ceil((N-1)/D) tokens against P + N - 1. TP's cache is as small for this MHA "
            "model; with GQA and fewer KV heads than D, TP replicates them, TSP never" + tokens,
            c["source"],
            where,
        )
    ]


def longest_context_rows(c: dict, cfg: ModelConfig, src: Sources) -> list[Row]:
    """The longest prompt each strategy serves within one GPU's memory (PROJECTED, analytic
    decode memory at batch 1, D from the claim, the claim's hardware preset)."""
    from tspbench.pipeline.projected_decode import longest_prompt

    D, hw = int(c["degree"]), c["hardware"]
    budget = usable_memory(load_preset(hw))
    longest: dict[str, int | str] = {}
    for s, lay in _layouts(c["strategies"], D):
        label = _spec(cfg, s, lay, 1024, c).label
        try:
            longest[label] = longest_prompt(
                lambda P, s=s, lay=lay: memory(_spec(cfg, s, lay, P, c))["peak"], budget
            )
        except ConfigError as e:  # a layout the model cannot split: say so, never drop it
            longest[label] = f"refused ({e})"
    numbers = {k: v for k, v in longest.items() if isinstance(v, int)}
    best = max(numbers, key=lambda k: numbers[k])
    others = [v for k, v in numbers.items() if k != c["subject"]]
    margin = numbers[c["subject"]] / max(others) if others else float("nan")
    return [
        Row(
            c["claim"],
            "TSP serves longer contexts per GPU (memory-efficient inference)",
            f"longest prompt in {budget / GiB:.0f} GiB ({hw}, PROJECTED): "
            + ", ".join(
                f"{k} {v // 1024}K" if isinstance(v, int) else f"{k} {v}"
                for k, v in longest.items()
            )  # fmt: skip
            + f"; TSP / best other = {margin:.2f}x",
            "projected: holds" if best == c["subject"] and margin > 1 else "differs",
            f"analytic decode memory per GPU ({cfg.name} bf16, batch 1, "
            f"{c.get('new_tokens', 128)} new tokens; peak = the larger of the prefill, a forward "
            "pass with the cache alive, and a decode step): the KV cache is split D ways by every "
            "strategy but single; TSP also splits the weights and the prefill's activations, "
            "where TP replicates the activations and SP the weights. Not validated on hardware.",
            c["source"],
            "tspbench/projection/decode.py",
        )
    ]
