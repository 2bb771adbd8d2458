"""Decode in the pipeline: sweep configs with the decode modes become cells (one per new_tokens),
bad decode settings stop check-config with one line (exit 2), the aggregate table carries the
decode record fields, and the decode tables and figures, the projected serving report and the
inference claims come out of synthetic records in seconds."""

from __future__ import annotations

import argparse
import json
import math

import matplotlib
import pandas as pd
import pytest
import yaml

matplotlib.use("Agg")

from tests.helpers.records import CPU, GPU, summary  # noqa: E402
from tests.helpers.runner import ROOT  # noqa: E402
from tspbench.cli import main  # noqa: E402

DEFAULT = yaml.safe_load((ROOT / "workflows/config/default.yaml").read_text())

DECODE = {
    "name": "decode",
    "strategies": ["tsp", "tp", "sp"],
    "degrees": [2],
    "gpus": [2],
    "seq_lens": [256, 1024],
    "batches": [1],
    "modes": ["decode"],
    "new_tokens": [4],
}


def config(*sweeps: dict, **top) -> dict:
    base = {k: v for k, v in DEFAULT.items() if k != "sweeps"}
    return {**base, "sweeps": [dict(s) for s in sweeps], **top}


def test_default_config_has_decode_cells_of_every_decoding_strategy():
    from tspbench.pipeline.cells import command, sweep_cells

    cells, filtered = sweep_cells(DEFAULT)
    dec = [c for c in cells if c.spec.decoding]
    assert {c.spec.strategy for c in dec} == {"single", "tsp", "tp", "sp"}
    assert {c.spec.seq_len for c in dec} >= {256, 2048} and {c.spec.batch for c in dec} >= {1, 4}
    assert all(c.spec.new_tokens == 8 and c.id.endswith(".decode.N8") for c in dec)
    assert not [f for f in filtered if f["mode"] == "decode"]
    shared = next(c for c in dec if c.id == "tsp.D2.g2.S256.B1.decode.N8")
    assert shared.sweeps == ("decode", "decode_batch")  # one run, in both sweeps
    single = next(c for c in dec if c.spec.strategy == "single")
    assert single.gpus == 1 and "decode" in single.sweeps
    line = command(shared, DEFAULT, "python")
    assert "--mode decode --new-tokens 8" in line and "--nproc 2" in line


def test_new_tokens_lists_make_one_cell_each_and_default_to_16():
    from tspbench.pipeline.cells import sweep_cells

    cells, _ = sweep_cells(config({**DECODE, "new_tokens": [2, 16], "seq_lens": [256]}))
    assert sorted(c.spec.new_tokens for c in cells if c.spec.strategy == "tsp") == [2, 16]
    plain = {k: v for k, v in DECODE.items() if k != "new_tokens"}
    cells, _ = sweep_cells(config({**plain, "modes": ["decode", "train"], "seq_lens": [256]}))
    by_mode = {(c.spec.strategy, c.spec.mode): c.spec.new_tokens for c in cells}
    assert by_mode[("tsp", "decode")] == 16 and by_mode[("tsp", "train")] == 0


BAD = [
    ("mode", {"modes": ["prefill"]}, "'prefill' is not one of"),
    ("new-tokens-1", {"new_tokens": [1]}, "new_tokens.0: 1 is less than the minimum of 2"),
    ("new-tokens-big", {"new_tokens": [65537]}, "65537 is greater than the maximum of 65536"),
    ("new-tokens-float", {"new_tokens": [8.0]}, "new_tokens.0: 8.0 is not of type 'integer'"),
    ("new-tokens-dup", {"new_tokens": [8, 8]}, "has non-unique elements"),
    ("new-tokens-train", {"modes": ["train"]}, "sweeps[0].new_tokens: only modes decode and"),
    ("no-decode-path", {"strategies": ["tsp", "fsdp_cp"]}, "fsdp_cp has no decode path"),
    ("dp", {"strategies": ["dp"]}, "dp has no decode path"),
    ("gpus", {"gpus": [4]}, "gpus: 4 is not one of sweeps[0].degrees [2]: decode runs one"),
    ("single", {"strategies": ["single", "tsp"]}, "single decodes on one rank (gpus [2])"),
    ("zigzag", {"seq_lens": [250]}, "250 must be divisible by 2*D = 4"),
    ("no-factors", {"strategies": ["tpsp"]}, "sweeps[0].tpsp: list the T x Sigma factorisations"),
    ("batch", {"batches": [0]}, "batches.0: 0 is less than the minimum of 1"),
]


@pytest.mark.parametrize("change, needle", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_decode_sweeps_exit_2_in_one_line(tmp_path, capsys, change, needle):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config({**DECODE, **change})))
    code = main(["check-config", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and err.count("\n") == 1, err


def test_new_tokens_schema_bounds_are_the_cli_bounds():
    from tspbench.cli import make_parser
    from tspbench.runtime.registry import schema

    sweep = schema("config.schema.yaml")["properties"]["sweeps"]["items"]
    items = sweep["properties"]["new_tokens"]["items"]
    sub = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in sub.choices["run"]._actions if "--new-tokens" in a.option_strings)
    for value, ok in ((items["minimum"], True), (items["maximum"], True),
                      (items["minimum"] - 1, False), (items["maximum"] + 1, False)):  # fmt: skip
        try:
            action.type(str(value))
            accepted = True
        except argparse.ArgumentTypeError:
            accepted = False
        assert accepted == ok, value


@pytest.fixture(scope="module")
def cpu(tmp_path_factory):
    """The default config's cells with synthetic CPU records, aggregated."""
    return summary(DEFAULT, tmp_path_factory.mktemp("cpu"), launcher="local", hardware=CPU)


def test_aggregate_carries_the_decode_fields(cpu):
    cells, df = cpu
    dec = df[df["mode"] == "decode"].set_index("cell")
    assert len(dec) == len([c for c in cells if c.spec.decoding]) > 0
    for col in ("new_tokens", "prefill_time_s", "decode_latency_s", "decode_latency_p90_s",
                "decode_tokens_per_s", "generated_tokens", "kv_cache_bytes",
                "decode_bytes_per_token"):  # fmt: skip
        assert dec[col].notna().all(), col
    row = dec.loc["tsp.D2.g2.S2048.B1.decode.N8"]
    assert json.loads(row["generated_tokens"]) == [[7] * 8]
    assert row["kv_cache_bytes"] * 2 == pytest.approx(
        dec.loc["single.D1.g1.S2048.B1.decode.N8", "kv_cache_bytes"], rel=0.01
    )
    assert df.loc[df["mode"] == "train", "kv_cache_bytes"].isna().all()


def test_a_record_of_other_new_tokens_is_corrupt(tmp_path):
    from tests.helpers.records import fake_record
    from tspbench.pipeline.aggregate import aggregate
    from tspbench.pipeline.cells import sweep_cells

    cells, _ = sweep_cells(config(DECODE))
    runs = tmp_path / "runs"
    runs.mkdir()
    for c in cells:
        rec = fake_record(c)
        if c.id == "tsp.D2.g2.S256.B1.decode.N4":
            rec["new_tokens"] = 16
        (runs / f"{c.id}.json").write_text(json.dumps(rec))
    df = aggregate(cells, runs).set_index("cell")
    bad = df.loc["tsp.D2.g2.S256.B1.decode.N4"]
    assert bad["status"] == "corrupt" and "new_tokens=16" in bad["error_message"]
    assert (df.drop(index="tsp.D2.g2.S256.B1.decode.N4")["status"] == "ok").all()


def test_decode_tables_show_every_decode_cell(cpu):
    from tspbench.pipeline.tables import specs

    cells, df = cpu
    tables = {name: (caption, t) for name, caption, t in specs(df)}
    caption, kv = tables["kv_cache_vs_seq"]
    assert "KV cache per CPU rank (KiB)" in caption and "D = 2, B = 1, 8 new tokens" in caption
    assert list(kv.index) == ["tsp", "tp", "sp", "single"] and list(kv.columns) == ["256", "2048"]
    assert "-" not in kv.values
    tsp, single = float(kv.loc["tsp", "2048"]), float(kv.loc["single", "2048"])
    assert single / tsp == pytest.approx(2, rel=0.01)
    for name in ("decode_memory_vs_seq", "decode_latency_vs_seq", "decode_bytes_vs_seq"):
        assert tables[name][1].shape == (4, 2), name
    _, thr = tables["decode_throughput_vs_batch"]
    assert list(thr.columns) == ["1", "4"] and "-" not in thr.values
    for c in cells:  # every decode cell has its number in a table
        s = c.spec
        if s.decoding and s.batch == 1:
            assert kv.loc[s.label, str(s.seq_len)] != "-", c.id
        if s.decoding and s.seq_len == 256:
            assert thr.loc[s.label, str(s.batch)] != "-", c.id


def test_decode_figures_name_the_device_and_mark_failed_cells(cpu, tmp_path):
    from tspbench.pipeline.decode_figures import (
        REFERENCE_LINE,
        decode_plots,
        draw,
        write_decode_figures,
    )
    from tspbench.pipeline.plotting import palette, styles
    from tspbench.pipeline.tables import specs

    _, df = cpu
    cell = "tp.D2.g2.S2048.B1.decode.N8"
    df = df.copy()
    df.loc[df["cell"] == cell, ["status", "error_message"]] = ["oom", "out of memory"]
    df.loc[df["cell"] == cell, ["kv_cache_bytes", "peak_mem_bytes"]] = math.nan
    figs = {p.name: p for p in decode_plots(df)}
    assert set(figs) == {"kv_cache_vs_seq", "decode_latency_vs_seq", "decode_throughput_vs_batch"}
    colors, marks = palette(df["label"]), styles(df["label"])
    fig = draw(figs["kv_cache_vs_seq"], colors, marks, df)
    ax, ax2 = fig.axes[:2]
    assert "per CPU rank" in ax.get_ylabel() and "per CPU rank" in ax2.get_ylabel()
    ref = next(ln for ln in ax.get_lines() if ln.get_label() == REFERENCE_LINE)
    single = df[(df["strategy"] == "single") & df["cell"].isin(figs["kv_cache_vs_seq"].data.cell)]
    assert list(ref.get_ydata()) == pytest.approx(sorted(single["kv_cache_bytes"] / 2 / 1024))
    crosses = [t.get_text() for t in ax.texts if t.get_text().startswith("tp:")]
    assert crosses == ["tp: OOM"]
    kv = {name: t for name, _, t in specs(df)}["kv_cache_vs_seq"]
    assert kv.loc["tp", "2048"] == "OOM"
    pngs = {p.stem for p in write_decode_figures(df, tmp_path, colors, marks) if p.suffix == ".png"}
    assert pngs == set(figs)

    gpu_cfg = config({**DECODE, "batches": [1, 4]}, model="7b", model_overrides={}, dtype="bf16")
    gpu_cfg["sweeps"][0]["seq_lens"] = [16384, 131072]
    _, gpu = summary(gpu_cfg, tmp_path / "gpu", hardware=GPU)
    figs = {p.name: p for p in decode_plots(gpu)}
    colors, marks = palette(gpu["label"]), styles(gpu["label"])
    fig = draw(figs["decode_throughput_vs_batch_S16384"], colors, marks, gpu)
    assert "prompt 16384" in fig.axes[0].get_title() and "B = " not in fig.axes[0].get_title()
    fig = draw(figs["kv_cache_vs_seq_B1"], colors, marks, gpu)
    assert "per GPU (GiB)" in fig.axes[0].get_ylabel()


def test_longest_prompt_is_the_largest_multiple_that_fits():
    from tspbench.pipeline.projected_decode import GRAIN, LONGEST, longest_prompt

    def peak(P: int) -> float:
        return 1000 + 3 * P

    assert longest_prompt(peak, 1000 + 3 * 5000) == 4 * GRAIN
    assert longest_prompt(peak, 1000 + 3 * GRAIN - 1) == 0
    assert longest_prompt(peak, math.inf) == LONGEST


def test_projected_serving_report(tmp_path):
    """7B at D = 8: every sharded strategy holds 1/8 of the single-GPU cache, and TSP serves the
    longest prompt in each preset's memory (TP replicates the prefill's activations, SP the
    weights); the figure says PROJECTED."""
    import matplotlib.pyplot as plt

    import tspbench.pipeline.projected_decode as pd_mod
    from tspbench.pipeline.projected import load

    cfg = load(str(ROOT / "workflows/config/projected.yaml"))
    cfg["decode"] |= {"seq_lens": [16384, 131072], "batches": [1], "budgets_gib": [80]}
    cfg["hardware"] = ["h100", "mi300x"]
    kept = {}
    save = pd_mod.save
    pd_mod.save = lambda fig, path: kept.setdefault(path.name, fig) and save(fig, path)
    try:
        pd_mod.write_decode_report(cfg, tmp_path, tmp_path, "note")
    finally:
        pd_mod.save = save
    kv = pd.read_csv(tmp_path / "decode_kv_cache.csv")
    at = kv[kv.seq_len == 131072].set_index("strategy")["kv_cache_gib"]
    assert at["single"] / at["tsp"] == pytest.approx(8, rel=0.01)
    ctx = pd.read_csv(tmp_path / "decode_context.csv")
    for budget, g in ctx.groupby("budget_gib"):
        longest = g.set_index("strategy")["longest_prompt"]
        assert longest.idxmax() == "tsp" and longest["single"] < longest["tsp"] / 4, budget
    md = (tmp_path / "decode_context.md").read_text()
    assert "PROJECTED" in md and "| mi300x" not in md.splitlines()[0]
    fig = kept["decode_context_projected"]
    assert fig._suptitle.get_text().startswith("PROJECTED")
    assert (tmp_path / "png/decode_context_projected.png").exists()
    plt.close(fig)


def test_inference_claims_from_measured_decode_cells(cpu, tmp_path):
    from tspbench.pipeline.claims import Sources, claims_table

    _, df = cpu
    df.to_csv(tmp_path / "summary.csv", index=False)
    src = Sources(ROOT / "results/reference/projected-7b", tmp_path / "summary.csv")
    rows = claims_table(src=src).set_index("claim")
    kv = rows.loc["TSP's KV cache per GPU is 1/D of the single-device cache (split by sequence)"]
    assert kv["verdict"] == "holds" and "8.000 at 128K" in kv["ours"]
    assert "measured here: 1.992 at P = 256, D = 2" in kv["ours"]
    assert "generated tokens equal single's in 9/9 cells" in kv["reason"]
    ctx = rows.loc[
        "Memory-efficient inference - TSP serves the longest context in one GPU's memory"
    ]
    assert ctx["verdict"] == "projected: holds" and "PROJECTED" in ctx["ours"]


def test_a_training_configs_recompute_does_not_reach_its_decode_cells():
    """paper.yaml trains with recompute full; its decode cells run no backward, so they are
    recorded with recompute none (run refuses decode with full) and none is filtered."""
    import yaml

    from tests.helpers.runner import ROOT
    from tspbench.pipeline.cells import sweep_cells

    cfg = yaml.safe_load((ROOT / "workflows/config/paper.yaml").read_text())
    cells, filtered = sweep_cells(cfg)
    assert cfg["recompute"] == "full" and not filtered
    assert {c.spec.recompute for c in cells if c.spec.decoding} == {"none"}
    assert {c.spec.recompute for c in cells if c.spec.mode == "train"} == {"full"}
