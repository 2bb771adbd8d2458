"""The run record's keys, in one place: what the writers, the aggregate and the schema share.

A record (``tspbench/schemas/record.schema.json``) is written group by group, in this order:
the run's inputs (:meth:`tspbench.runtime.spec.RunSpec.header`: :data:`INPUTS`, every strategy's
options, :data:`SETUP`), where it ran (:data:`PLACEMENT`, :data:`PROVENANCE`), its
:data:`OUTCOME`, an ok run's measurements (:data:`RUN_SUMMARY`, or :data:`DECODE_SUMMARY` in the
decode modes), then :data:`CLOSING`. The options are not listed here: they are the registry's
(:func:`tspbench.runtime.registry.all_options`), and a plug-in strategy brings its own.

The summaries are built through :func:`ordered`, so they write exactly their list, in its order;
``tests/unit/test_record_keys.py`` checks the schema's properties and required keys, the header
and the aggregate's columns against these lists.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# RunSpec.header, before the options (new_tokens in the decode modes only; pp, pp_schedule and
# microbatches in pipelined runs only)
INPUTS = (
    "schema_version",
    "strategy",
    "model",
    "seq_len",
    "degree",
    "tp",
    "sp",
    "dp",
    "pp",
    "pp_schedule",
    "microbatches",
    "world_size",
    "mode",
    "new_tokens",
    "batch",
    "global_batch",
    "dtype",
    "warmup",
    "steps",
    "seed",
    "max_memory",
    "recompute",
)
PIPELINE = ("pp", "pp_schedule", "microbatches")  # INPUTS of a pipelined run only
SETUP = ("model_config", "launcher")  # RunSpec.header, after the options
PLACEMENT = ("model_group", "rank_nodes", "model_group_spans_nodes")  # once the ranks joined
PROVENANCE = ("hardware", "versions", "git_commit", "attention_backend")  # likewise
OUTCOME = ("status", "error_message", "failed_ranks")  # the last two: a run that failed

MEMORY = (  # every ok record's first measurements
    "peak_mem_bytes",
    "peak_mem_bytes_per_rank",
    "peak_mem_bytes_first_step",
    "peak_mem_bytes_first_step_per_rank",
    "peak_mem_source",
    "peak_parts_bytes",
    "peak_reserved_bytes_per_rank",
)
DECODE = (  # a decode-mode record's own measurements, between MEMORY and STEP
    "kv_cache_bytes",
    "kv_cache_bytes_per_rank",
    "prefill_time_s",
    "prefill_times_s",
    "decode_latency_s",
    "decode_latency_p90_s",
    "decode_tokens_per_s",
    "generate_time_s",
    "generated_tokens",
    "decode_bytes_per_token",
    "decode_bytes_per_token_by_kind",
    "decode_bytes_per_token_per_rank",
    "prefill_comm_bytes",
)
STEP = (  # the record's step (a decode step or a generation in the decode modes) and the rest
    "step_time_s",
    "step_time_min_s",
    "step_time_max_s",
    "step_times_s",
    "tokens_per_s",
    "comm_bytes",
    "comm_bytes_total",
    "comm_bytes_model_group",
    "comm_bytes_dp",
    "comm_bytes_per_rank",
    "flops_counted",
    "flops_per_step",
    "flops_executed_per_step",
    "flops_per_rank",
    "mfu",
    "param_numel_per_rank",
    "optimizer_numel_per_rank",
    "loss",
    "grad_norm",
    "calib_gflops",
    "startup_s",
    "tokens_per_s_per_gflops",
)
RUN_SUMMARY = (*MEMORY, *STEP)  # tspbench.runtime.measure.summarize
PIPELINE_SUMMARY = (  # after RUN_SUMMARY, in pipelined runs only (measure.pipeline_summary)
    "pp_stage_per_rank",
    "pp_schedule_s_per_rank",
    "pp_busy_s_per_rank",
    "pp_bubble_fraction_per_rank",
    "pp_bubble_closed_form",
    "comm_bytes_pp_per_rank",
)
MOE_SUMMARY = (  # after them, in runs of a model with experts only (measure.moe_summary)
    "tokens_per_expert",
    "expert_load_imbalance",
)
DECODE_SUMMARY = (*MEMORY, *DECODE, *STEP)  # tspbench.runtime.decode.summarize_decode
CLOSING = ("wall_s", "timestamp_utc")  # when rank 0 writes it


def ordered(keys: tuple[str, ...], values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` in the order of ``keys``, which they must match exactly (KeyError naming the
    difference): a summary cannot write a key that the list, and so the schema's check, does not
    know, nor leave one out."""
    unlisted = sorted(values.keys() - set(keys))
    missing = [k for k in keys if k not in values]
    if unlisted or missing:
        raise KeyError(f"record keys: {unlisted} not listed, {missing} not given")
    return {k: values[k] for k in keys}
