"""Tables and figures from synthetic aggregate tables: failed and OOM cells are shown; missing
and corrupt records get rows."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd

from tests.helpers.configs import MINI


def test_tables_and_figures_mark_oom_and_failed_cells(tmp_path):
    from tspbench.pipeline.figures import write_figures
    from tspbench.pipeline.tables import write_tables

    rows = []
    for s in ("tsp", "tp"):
        for S in (256, 512, 1024):
            status = "ok"
            if (s, S) == ("tp", 1024):
                status = "oom"
            if (s, S) == ("tsp", 512):
                status = "error"
            rows.append(
                {
                    "cell": f"{s}.{S}",
                    "sweep": "seq",
                    "label": s,
                    "strategy": s,
                    "seq_len": S,
                    "gpus": 4,
                    "degree": 4,
                    "batch": 1,
                    "mode": "train",
                    "dtype": "fp32",
                    "status": status,
                    "error_message": None if status == "ok" else "boom",
                    "peak_mem_bytes": S * 1000 if status == "ok" else None,
                    "tokens_per_s": 1e3 if status == "ok" else None,
                    "param_numel": 10,
                    "optimizer_numel": 20,
                }
            )
    df = pd.DataFrame(rows)
    write_tables(df, tmp_path / "t")
    table = (tmp_path / "t/md/memory_vs_seq.md").read_text()
    assert "OOM" in table and "failed" in table
    assert "tsp.512" in (tmp_path / "t/failures.md").read_text()
    written = write_figures(df, tmp_path / "f")
    assert {p.name for p in written} >= {"memory_vs_seq.png", "throughput_vs_seq.pdf"}


def test_aggregate_reports_missing_and_corrupt_records(tmp_path):
    from tspbench.pipeline.aggregate import aggregate
    from tspbench.pipeline.cells import sweep_cells

    cells, _ = sweep_cells(MINI)
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / f"{cells[0].id}.json").write_text("{not json")
    oom = {**cells[1].spec.header("local", cells[1].gpus), "status": "oom", "error_message": "x"}
    (runs / f"{cells[1].id}.json").write_text(json.dumps({**oom, "timestamp_utc": "2026-01-01"}))
    df = aggregate(cells, runs).set_index("cell")
    assert df.loc[cells[0].id, "status"] == "corrupt"
    assert df.loc[cells[1].id, "status"] == "oom"
    assert df.loc[cells[2].id, "status"] == "missing"


def test_training_traffic_table_states_both_crossovers(tmp_path):
    """The training sweep's bytes get a table of their own, captioned with the analytic forward
    and training crossovers of TSP and TP for the table's model (issue 19)."""
    from tspbench.pipeline.tables import specs

    rows = [
        {"cell": f"{s}.{S}", "sweep": "seq", "label": s, "strategy": s, "seq_len": S,
         "gpus": 2, "degree": 2, "batch": 1, "mode": "train", "dtype": "fp32", "status": "ok",
         "peak_mem_bytes": 1e6, "tokens_per_s": 1e3, "comm_bytes_total": 1e3 * S,
         "model": "tiny", "hidden": 64, "kv_dim": 64, "ffn": 256}
        for s in ("tsp", "tp") for S in (256, 1024)
    ]  # fmt: skip
    found = {name: caption for name, caption, _ in specs(pd.DataFrame(rows))}
    caption = found["comm_vs_seq_train"]
    assert "per training step when B x S > 1,096 (17.1h)" in caption
    assert (
        "recompute full: B x S > 1,346" in caption
        and "per forward pass when B x S > 414" in caption
    )


def test_crossovers_of_a_model_with_wide_heads_use_its_q_width():
    """A summary of Qwen3 4B (run as llama3-8b with overrides, as `tspbench plan` writes it)
    names its heads and Q's width: the caption's crossover is the analytic one of a model with
    W_q and W_o 4096 x 2560, not 2560 x 2560 (the rest, vocabulary and depth, the preset's: the
    table does not carry them); so is the figure's."""
    from tspbench.core.config import get_config, read_hf_config
    from tspbench.pipeline.figures import crossover_bs
    from tspbench.pipeline.tables import crossovers
    from tspbench.projection.analytic import crossover

    qwen, _ = read_hf_config("workflows/models/qwen3-4b.json")
    cfg = get_config("llama3-8b", hidden=qwen.hidden, heads=qwen.heads, kv_heads=qwen.kv_heads,
                     ffn=qwen.ffn, head_dim=qwen.head_dim)  # fmt: skip
    rows = [
        {"status": "ok", "model": "llama3-8b", "hidden": cfg.hidden, "kv_dim": cfg.kv_dim,
         "ffn": cfg.ffn, "heads": cfg.heads, "q_dim": cfg.q_dim, "degree": 8}
    ]  # fmt: skip
    want = crossover(cfg, "tsp", "tp", "infer", "none", degree=8)
    assert f"B x S > {want:,.0f}" in crossovers(pd.DataFrame(rows), "infer")
    # read with heads of h / heads = 80: another crossover
    narrow = crossover(dataclasses.replace(cfg, head_dim=0), "tsp", "tp", "infer", "none", degree=8)
    assert f"{narrow:,.0f}" not in crossovers(pd.DataFrame(rows), "infer")
    h, kv, f, q = cfg.hidden, cfg.kv_dim, cfg.ffn, cfg.q_dim
    assert crossover_bs(h, kv, f, q) == (2 * h * q + 2 * h * kv + 3 * h * f) / (4 * h - 2 * kv)
    assert crossover_bs(h, kv, f, q) > crossover_bs(h, kv, f)


def test_an_implementation_is_tabled_beside_the_layout_it_implements():
    """A strategy that ``implements`` another's layout gets a table of the cells both ran, with
    theirs / ours ratios; a cell only one of them ran is left out, and a failed one too."""
    from tspbench.pipeline.tables import specs
    from tspbench.runtime.registry import strategies

    theirs = next(n for n, s in strategies().items() if s.implements)
    ours = strategies()[theirs].implements
    rows = []
    for s, peak, sent, rate in ((ours, 2e6, 1e6, 100.0), (theirs, 3e6, 1.5e6, 50.0)):
        for S, status in ((256, "ok"), (512, "ok" if s == ours else "error"), (1024, "ok")):
            if (s, S) == (theirs, 1024):
                continue  # only ours ran it
            rows.append({
                "cell": f"{s}.{S}", "sweep": "seq", "label": s, "strategy": s, "seq_len": S,
                "gpus": 4, "degree": 4, "batch": 1, "mode": "train", "dtype": "fp32",
                "recompute": "none", "cp_comm": "all_gather", "cp_a2a": 0, "status": status,
                "peak_mem_bytes": peak * S / 256, "comm_bytes_total": sent, "tokens_per_s": rate,
            })  # fmt: skip
    # cells both ran that differ in what the key must hold apart: more GPUs (data parallel), and
    # ours with an option of its own off (FSDP+CP's overlap), which theirs cannot be paired with
    for r in [r for r in rows if r["seq_len"] == 256]:
        rows.append({**r, "cell": r["cell"] + ".g8", "gpus": 8})
    own = [o for o in strategies()[ours].options if o.name not in {"cp_comm", "cp_a2a"}]
    for o in own:  # listed first, and ten times the peak: a wrong pairing shows in the ratio
        off = [r for r in rows if r["strategy"] == ours and r["gpus"] == 4]
        rows[:0] = [{**r, "cell": f"{r['cell']}.{o.name}", o.name: not o.default,
                     "peak_mem_bytes": 10 * r["peak_mem_bytes"]} for r in off]  # fmt: skip
    tables = {name: t for name, _, t in specs(pd.DataFrame(rows))}
    table = tables[f"implementations_{theirs}"]
    cells = [
        "seq_len=256 degree=4 gpus=4 batch=1 dtype=fp32 recompute=none cp_comm=all_gather cp_a2a=0"
    ]
    assert list(table.index) == [*cells, cells[0].replace("gpus=4", "gpus=8")]
    ratios = table.loc[table.index[0], [c for c in table.columns if c.endswith("ratio")]]
    assert list(ratios) == ["1.500", "1.500", "0.500"]  # peak, bytes, tokens/s


def test_an_implementation_with_options_of_its_own_has_a_row_per_setting():
    """tp_torch's sequence parallelism (an option TP lacks): each of its settings is a row of
    its own beside the same TP cell, named by the setting."""
    from tspbench.pipeline.tables import specs

    rows = [
        {"cell": f"{s}.{sp}", "sweep": "seq", "label": s, "strategy": s, "seq_len": 512,
         "gpus": 4, "degree": 4, "batch": 1, "mode": "train", "dtype": "fp32",
         "recompute": "none", "sequence_parallel": sp, "status": "ok",
         "peak_mem_bytes": peak, "comm_bytes_total": 1e6, "tokens_per_s": 100.0}
        for s, sp, peak in (("tp", False, 2e6), ("tp_torch", False, 3e6), ("tp_torch", True, 1e6))
    ]  # fmt: skip
    table = {name: t for name, _, t in specs(pd.DataFrame(rows))}["implementations_tp_torch"]
    cell = "seq_len=512 degree=4 gpus=4 batch=1 dtype=fp32 recompute=none"
    assert list(table.index) == [
        f"{cell} sequence_parallel=False",
        f"{cell} sequence_parallel=True",
    ]
    assert list(
        table[[c for c in table.columns if c.startswith("peak") and "ratio" in c]].iloc[:, 0]
    ) == ["1.500", "0.500"]
