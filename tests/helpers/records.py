"""Synthetic run records (record.schema.json, status ok) for the table and figure tests: a
builder of one cell's record with plausible numbers, decode fields for the decode modes, and the
aggregate table of a whole config made from them; and the keys a real record carries, in order,
from their one list (tspbench.runtime.record_keys)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

GPU = {"device_type": "cuda", "device_name": "AMD Instinct MI300X", "cpu_count": 192}
CPU = {"device_type": "cpu", "device_name": "AMD EPYC 7763 64-Core Processor", "cpu_count": 2}


def fake_record(cell, launcher: str = "slurm", hardware: dict | None = None) -> dict:
    """A valid ``ok`` record of ``cell`` (record.schema.json) with plausible numbers: memory
    grows with S x B / D, a step takes longer with more tokens, strategies differ a little."""
    from tspbench.runtime.registry import strategies

    spec, gpus = cell.spec, cell.gpus
    header = spec.header(launcher, gpus)
    S, B, D, dp = spec.seq_len, spec.batch, spec.layout.degree, spec.layout.dp
    k = 1 + 0.1 * list(strategies()).index(spec.strategy)
    train = spec.mode == "train"
    peak = int(k * (2**26 + 2**12 * S * B / D) * (3 if train else 1))
    step = k * 1e-5 * S * B * (3 if train else 1) / D
    hw = {**(hardware or GPU), "device_count": gpus, "host": "node0"}
    return {
        **header,
        "status": "ok",
        "peak_mem_bytes": peak,
        "peak_mem_bytes_per_rank": [peak] * gpus,
        "peak_mem_bytes_first_step": peak,
        "peak_parts_bytes": parts(peak, D) if not spec.decoding else None,
        "step_time_s": step,
        "step_time_min_s": 0.9 * step,
        "step_time_max_s": 1.2 * step,
        "step_times_s": [0.9 * step, step, 1.2 * step],
        "tokens_per_s": B * dp * S / step,
        "comm_bytes": {"all_gather": 1e3 * S / k, "all_reduce": 2e3 * S},
        "comm_bytes_total": 1e3 * S / k + 2e3 * S,
        "flops_per_step": int(6e6 * S * B),
        "param_numel_per_rank": [10**6 // D] * gpus,
        "optimizer_numel_per_rank": [2 * 10**6 // D] * gpus,
        "loss": 10.4,
        "grad_norm": 1.5 if train else None,
        "hardware": hw,
        "versions": {"python": "3.12", "torch": "2.13.0"},
        "git_commit": "0123abc",
        "timestamp_utc": "2026-01-01T00:00:00+00:00",
        **(decode_fields(spec, k) if spec.decoding else {}),
        **(expert_fields(spec) if spec.cfg.moe else {}),
    }


def expert_fields(spec) -> dict:
    """A run with experts' two fields: every routed row counted, the first expert busiest."""
    E, rows = spec.cfg.experts, spec.seq_len * spec.batch * spec.layout.dp * spec.cfg.top_k
    per = [rows * spec.cfg.layers // E] * E
    per[0], per[-1] = per[0] + E, per[-1] - E
    return {"tokens_per_expert": per, "expert_load_imbalance": per[0] / (sum(per) / E)}


def parts(peak: int, D: int) -> dict[str, int]:
    """A split of ``peak`` by part (measure.PARTS): the model state shrinking with D."""
    from tspbench.runtime.measure import PARTS

    state = {"weights": 4 * 10**6 // D, "gradients": 2 * 10**6 // D}
    fixed = {**state, "optimizer state": 8 * 10**6 // D, "inputs": 4096, "collective staging": 1024}
    out = {p: fixed.get(p, 0) for p in PARTS}
    out["activations and temporaries"] = peak - sum(out.values())
    return out


def decode_fields(spec, k: float) -> dict:
    """A decode record's own fields: the cache of the closed form, a latency growing with the
    prompt and the batch, the same generated tokens for every strategy."""
    latency = k * 1e-3 * (1 + spec.seq_len * spec.batch / 1e4)
    return {
        "new_tokens": spec.new_tokens,
        "kv_cache_bytes": spec.impl.decoder.kv_cache_bytes(spec),
        "prefill_time_s": 10 * latency,
        "decode_latency_s": latency,
        "decode_latency_p90_s": 1.3 * latency,
        "decode_tokens_per_s": spec.batch / latency,
        "generate_time_s": 10 * latency + (spec.new_tokens - 1) * latency,
        "generated_tokens": [[7] * spec.new_tokens for _ in range(spec.batch)],
        "decode_bytes_per_token": 1e3 * k * spec.batch,
        "prefill_comm_bytes": 1e4 * spec.seq_len,
        "loss": None,
    }


def write_records(cells, runs: Path, **kw) -> None:
    runs.mkdir(parents=True, exist_ok=True)
    for c in cells:
        (runs / f"{c.id}.json").write_text(json.dumps(fake_record(c, **kw)))


def summary(config: dict, tmp_path: Path, **kw) -> tuple[list, pd.DataFrame]:
    """Every cell of ``config`` with a synthetic ok record, aggregated as the pipeline does."""
    from tspbench.pipeline.aggregate import aggregate
    from tspbench.pipeline.cells import sweep_cells

    cells, _ = sweep_cells(config)
    write_records(cells, tmp_path / "runs", **kw)
    df = aggregate(cells, tmp_path / "runs")
    assert set(df["status"]) == {"ok"}, df[df["status"] != "ok"]["error_message"].tolist()
    return cells, df


def header_keys(mode: str, pipelined: bool = False) -> list[str]:
    """The keys of ``RunSpec.header`` for ``mode``, in order: the inputs, every strategy's
    options, the setup (``pipelined``: a run with pipeline stages)."""
    from tspbench.runtime import record_keys as rk
    from tspbench.runtime.registry import all_options
    from tspbench.runtime.spec import DECODE_MODES

    inputs = [k for k in rk.INPUTS if mode in DECODE_MODES or k != "new_tokens"]
    inputs = [k for k in inputs if pipelined or k not in rk.PIPELINE]
    return [*inputs, *all_options(), *rk.SETUP]


def written_keys(mode: str, pipelined: bool = False, experts: bool = False) -> list[str]:
    """The keys of an ok record of ``mode``, in the order ``tspbench run`` writes them."""
    from tspbench.runtime import record_keys as rk
    from tspbench.runtime.spec import DECODE_MODES

    summary = rk.DECODE_SUMMARY if mode in DECODE_MODES else rk.RUN_SUMMARY
    summary = (*summary, *rk.MOE_SUMMARY) if experts else summary
    summary = (*summary, *rk.PIPELINE_SUMMARY) if pipelined else summary
    after = [*rk.PLACEMENT, *rk.PROVENANCE, "status", *summary, *rk.CLOSING]
    return [*header_keys(mode, pipelined), *after]
