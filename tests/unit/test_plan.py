"""``tspbench plan``: enumerates every strategy's layouts, ranks them by projected throughput
among those that fit, explains what it filters, reads Hugging Face configs (refusing what the
model cannot express) and answers in seconds. Operations are counted for real in one test; the
others stub the count (it only adds dispatch time) so that they stay fast."""

from __future__ import annotations

import dataclasses
import json
import re
import time

import pytest
import yaml

from tspbench.cli import main
from tspbench.core.config import PRESETS, ConfigError, hf_config
from tspbench.projection import costmodel
from tspbench.projection.plan import Request, check, load_config, search, sweep, write_map
from tspbench.runtime.registry import searched
from tspbench.runtime.spec import RunSpec

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}


def noted(notes: list[str]) -> set[str]:
    """The config.json keys that ``notes`` name (each note starts ``key=value:``)."""
    return {n.split("=", 1)[0] for n in notes}


@pytest.fixture
def counted(monkeypatch):
    """A dispatch count that costs nothing (the real one: seconds per configuration); the
    shrunk copies counted are recorded."""
    keys = []

    def counts(key):  # the shrunk copy's one- and two-layer counts
        keys.append(key)
        n = 5000 + 3000 * key.layout.degree + 100 * key.options.get("kv_bucket", 0)
        return n, n + 100

    monkeypatch.setattr(costmodel, "layer_counts", counts)
    return keys


def plan_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["plan", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


FITS = 9 + len(searched())  # the table's "fits" column: after M and the searched options


def table_rows(out: str) -> list[list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["#", "strategy"])
    assert re.split(r"\s{2,}", lines[start].strip())[FITS] == "fits"
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip() or not line.split()[0].isdigit():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))  # labels such as "tpsp (2x4)"
    return rows


def test_ranks_strategies_and_prints_commands(capsys, counted, tmp_path):
    rc, out, _ = plan_cli(capsys, "--model", "7b", "--hardware", "mi300x", "--seq-len", 131072,
                          "--gpus", 8, "--cache", tmp_path)  # fmt: skip
    assert rc == 0
    rows = table_rows(out)
    assert len(rows) >= 10 and len({r[1] for r in rows}) >= 3
    assert rows[0][FITS] == "yes"  # fitting rows first
    fits = [r[FITS] for r in rows]
    assert fits == sorted(fits, key=lambda f: f != "yes")
    best = rows[0][1]  # whichever wins: the projection decides, the test does not
    assert f"best plan: {best} D={rows[0][2]} dp={rows[0][3]} B={rows[0][4]}" in out
    run = next(line.strip() for line in out.splitlines() if line.strip().startswith("tspbench run"))
    srun = next(line.strip() for line in out.splitlines() if line.strip().startswith("srun "))
    assert f"--strategy {best}" in run and "--nproc 8" in run and "--launch env" in srun
    # the best plan and its run line carry the best row's options where its strategy has them
    # (TSP: MLP schedule and KV bucket, SP and FSDP+CP: K/V exchange; "-" in the table where
    # it has none), each in its own column after M and recompute
    line = next(line for line in out.splitlines() if line.startswith("best plan:"))
    cols = {name: 7 + i for i, name in enumerate(searched())}
    for name, col in cols.items():
        flag, value = "--" + name.replace("_", "-"), rows[0][col]
        if value == "-":
            assert flag not in run and f" {name}=" not in line
        else:
            assert f"{flag} {value}" in run and f" {name}={value}" in line
    # the pipeline snippet is a sweep config the pipeline accepts
    from tspbench.pipeline.cells import sweep_cells

    snippet = out.split("pipeline config (workflows/config/<name>.yaml):\n", 1)[1]
    cells, filtered = sweep_cells(yaml.safe_load(snippet))
    assert len(cells) == 1 and not filtered and cells[0].spec.strategy == best
    opts = cells[0].spec.options  # the sweep's options: the best row's
    flat = cells[0].spec.layout.pp == 1  # (an option of pipelines only: "-" without one)
    shown = [
        "-"
        if n not in opts or (flat and searched()[n].pipelines_only)
        else searched()[n].text(opts[n])
        for n in cols
    ]
    assert shown == [rows[0][c] for c in cols.values()]


def test_json_best_7b_128k_on_8_mi300x_fits(capsys, counted, tmp_path):
    rc, out, _ = plan_cli(capsys, "--model", "7b", "--hardware", "mi300x", "--seq-len", 131072,
                          "--gpus", 8, "--json", "--cache", tmp_path)  # fmt: skip
    assert rc == 0
    obj = json.loads(out)
    keys = {"strategy", "degree", "tp", "sp", "dp", "batch", "recompute", "fits",
            "peak_mem_bytes", "tokens_per_s"}  # fmt: skip
    assert obj["candidates"] and all(keys <= set(c) for c in obj["candidates"])
    assert len({c["strategy"] for c in obj["candidates"]}) >= 6
    best = obj["best"]
    assert best["fits"] and best["peak_mem_bytes"] <= 192 * 2**30 and best["throughput_exact"]
    assert best["degree"] * best["dp"] == 8
    fitting = [c for c in obj["candidates"] if c["fits"]]
    assert best["tokens_per_s"] >= max(c["tokens_per_s"] for c in fitting if c["throughput_exact"])
    # every refused candidate says which rule
    assert all(c["binding"] for c in obj["candidates"] if not c["fits"])
    assert "tspbench run" in best["run"] and best["srun"].startswith("srun ")


def test_from_a_hugging_face_config(capsys, counted, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    cfg, notes = hf_config(LLAMA3_8B)
    same = [f for f in ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn", "rope_theta")
            if getattr(cfg, f) == getattr(PRESETS["llama3-8b"], f)]  # fmt: skip
    assert len(same) == 7 and noted(notes) == {"torch_dtype", "max_position_embeddings"}
    _, notes = hf_config({**LLAMA3_8B, "attention_dropout": 0.1, "pretraining_tp": 2})
    assert noted(notes) == {"torch_dtype", "max_position_embeddings", "attention_dropout",
                            "pretraining_tp"}  # fmt: skip
    rc, out, _ = plan_cli(capsys, "--model", path, "--hardware", "h100", "--seq-len", 32768,
                          "--gpus", 16, "--cache", tmp_path)  # fmt: skip
    assert rc == 0 and "8 KV" in out and "best plan:" in out
    assert "note: max_position_embeddings=8192: the context it was trained to" in out
    # a model that is no preset runs as the nearest preset with --set for what differs
    run = next(line for line in out.splitlines() if line.strip().startswith("tspbench run"))
    assert "--model llama3-8b" in run or "--set" in run


@pytest.mark.parametrize(
    "arch, mtype", [("LlamaForCausalLM", "llama"), ("MistralForCausalLM", "mistral")]
)
def test_a_tiny_llama_or_mistral_file_is_the_tiny_preset(arch, mtype):
    """A Llama or Mistral config.json with the ``tiny`` preset's values reads as that preset,
    field for field: every strategy's equality with the reference on it (test_equivalence,
    test_scale) is then that of a run of the file; test_cli runs the Qwen2 and Qwen3 files,
    whose reading differs (biases, QK norms), through ``tspbench run`` for every strategy."""
    tiny = PRESETS["tiny"]
    data = {"architectures": [arch], "model_type": mtype, "vocab_size": tiny.vocab,
            "hidden_size": tiny.hidden, "num_hidden_layers": tiny.layers,
            "num_attention_heads": tiny.heads, "num_key_value_heads": tiny.kv_heads,
            "intermediate_size": tiny.ffn, "rope_theta": tiny.rope_theta,
            "rms_norm_eps": tiny.norm_eps, "tie_word_embeddings": False, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "sliding_window": None}  # fmt: skip
    if mtype == "mistral":
        del data["attention_bias"], data["mlp_bias"]  # (Mistral's config has neither)
    cfg, notes = hf_config(data)
    assert cfg == dataclasses.replace(tiny, name="custom") and not notes


@pytest.mark.parametrize(
    "change, key",
    [
        ({"num_local_experts": 8, "num_experts_per_tok": 2}, "num_local_experts"),
        ({"n_routed_experts": 64}, "n_routed_experts"),
        ({"attention_bias": 1}, "attention_bias"),
        (
            {
                "model_type": "mistral",
                "architectures": ["MistralForCausalLM"],
                "attention_bias": True,
            },
            "attention_bias",
        ),
        (
            {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "mlp_bias": True},
            "mlp_bias",
        ),
        ({"sliding_window": 4096}, "sliding_window"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"head_dim": 127}, "head_dim"),  # odd: RoPE rotates pairs
        ({"head_dim": "128"}, "head_dim"),
        ({"vocab_size": 2**21}, "vocab_size"),
        ({"num_key_value_heads": 5}, "num_key_value_heads"),
        ({"architectures": ["LlamaMoEForCausalLM"]}, "architectures"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
        ({"shared_expert_intermediate_size": 5632}, "shared_expert_intermediate_size"),
        ({"decoder_sparse_step": 1}, "decoder_sparse_step"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_refuses_what_the_model_cannot_express(capsys, tmp_path, change, key):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA3_8B, **change}))
    rc, out, err = plan_cli(capsys, "--model", path, "--seq-len", 8192, "--gpus", 8)
    assert rc == 2 and not out
    assert len(err.strip().splitlines()) == 1 and key in err, err


def test_head_dim_read_where_it_is_not_hidden_over_heads():
    """Qwen3 0.6B's heads are 128 wide for h = 1024 over 16 heads: Q is 2h wide; a head_dim
    equal to hidden/heads (Llama 3's 128) reads as the default."""
    cfg, _ = hf_config({**LLAMA3_8B, "hidden_size": 1024, "num_attention_heads": 16,
                        "head_dim": 128})  # fmt: skip
    assert cfg.head_dim == cfg.d_head == 128 and cfg.q_dim == 2048
    cfg, _ = hf_config({**LLAMA3_8B, "head_dim": 128})
    assert cfg.head_dim == 0 and cfg.d_head == 128 and cfg == hf_config(LLAMA3_8B)[0]


def test_missing_key_and_sliding_window_null_accepted():
    with pytest.raises(ConfigError, match="hidden_size: missing"):
        hf_config({k: v for k, v in LLAMA3_8B.items() if k != "hidden_size"})
    cfg, notes = hf_config({**LLAMA3_8B, "sliding_window": None, "rope_scaling": None})
    assert cfg.kv_heads == 8 and cfg.rope_scaling == "" and "sliding_window" not in noted(notes)
    # null reads as Hugging Face reads it: no num_key_value_heads is MHA, no rope_theta 10000
    cfg, _ = hf_config({**LLAMA3_8B, "num_key_value_heads": None, "rope_theta": None})
    assert cfg.kv_heads == cfg.heads == 32 and cfg.rope_theta == 10000.0


def test_gqa_explains_why_tsp_is_filtered_at_d16(capsys, counted, tmp_path):
    rc, out, _ = plan_cli(capsys, "--model", "llama3-8b", "--hardware", "h100", "--seq-len",
                          65536, "--gpus", 16, "--max-degree", 16, "--cache", tmp_path)  # fmt: skip
    assert rc == 0
    filtered = out.split("\nfiltered:\n", 1)[1]
    assert "tsp D=16: model.kv_heads=8: must be divisible by D (degree)=16" in filtered
    assert "tp D=16: model.kv_heads=8" in filtered
    assert all(r[1] != "tsp" or r[2] != "16" for r in table_rows(out))
    # at the default degree cap (a node) the reason is given too
    rc, out, _ = plan_cli(capsys, "--model", "llama3-8b", "--hardware", "h100", "--seq-len",
                          65536, "--gpus", 16, "--cache", tmp_path)  # fmt: skip
    assert "D=16: above --max-degree 8" in out and "tsp D=16: model.kv_heads=8" in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--hardware", "tpu"], "--hardware='tpu'"),
        (["--hardware", "h100", "--memory-cap", "-1"], "--memory-cap"),
        (["--gpus", "0"], "--gpus"),
        (["--seq-len", "2e5"], "--seq-len"),
        (["--model", "missing/config.json"], "no such config.json file"),
        (["--model", "70b"], "--model='70b'"),
        (["--pp", "0"], "--pp"),
        (["--pp-schedule", "zbv"], "--pp-schedule"),
        (["--pp-schedule", "interleavedzb"], "--pp-schedule=interleavedzb: a zero-bubble sch"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, counted, argv, needle):
    args = {"--model": "7b", "--seq-len": "131072", "--gpus": "8"}
    args.update(zip(argv[::2], argv[1::2]))
    try:
        rc = main(["plan", *[x for kv in args.items() for x in kv], "--no-cache"])
    except SystemExit as e:  # argparse's errors
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2 and not out and needle in err and len(err.strip().splitlines()) == 1, err


def test_global_batch_sets_the_micro_batch(counted):
    req = Request.make("7b", "mi300x", 32768, 16, global_batch=8)
    p = search.plan(req, use_cache=False)
    for c in p.candidates:
        if c.spec is not None:
            assert c.batch * c.layout.dp == 8
    assert p.best is not None and search.limit(p.rows[0], req) == "global batch"


def test_answers_in_seconds_for_1024_gpus(counted):
    t0 = time.perf_counter()
    p = search.plan(Request.make("7b", "mi300x", 131072, 1024), use_cache=False)
    assert time.perf_counter() - t0 < 20 and p.best is not None and p.best.fits
    assert {c.layout.world_size for c in p.candidates} == {1024}


def test_tries_tsp_mlp_schedules_and_every_kv_bucket(capsys, counted, tmp_path):
    """TSP's candidates: ring and broadcast MLP, and every bucket that splits a head group's KV
    heads (7B: 32 KV heads, so 32/D per group); each with the analytic memory, which sizes K/V
    by whole head groups, so a bucket's peak is its twin's. A bucket dispatches more, so it
    never outranks its twin and is never counted; ``--mlp-schedule`` keeps the user's."""
    rc, out, _ = plan_cli(capsys, "--model", "7b", "--hardware", "mi300x", "--seq-len", 131072,
                          "--gpus", 8, "--json", "--cache", tmp_path)  # fmt: skip
    cands = json.loads(out)["candidates"]
    tsp = [c for c in cands if c["strategy"] == "tsp" and c["peak_mem_bytes"] is not None
           and c["pp"] == 1]  # fmt: skip
    for D, buckets in ((2, {0, 1, 2, 4, 8}), (4, {0, 1, 2, 4}), (8, {0, 1, 2})):
        assert {c["kv_bucket"] for c in tsp if c["degree"] == D} == buckets
    assert {c["mlp_schedule"] for c in tsp} == {"ring", "broadcast"}
    assert all(c["mlp_schedule"] is None and c["kv_bucket"] is None
               for c in cands if c["strategy"] != "tsp")  # fmt: skip
    twins: dict[tuple, dict] = {}
    for c in tsp:
        twins.setdefault((c["degree"], c["batch"], c["recompute"], c["mlp_schedule"]), {})[
            c["kv_bucket"]] = c  # fmt: skip
    assert len(twins) == 3 * 16 * 2 * 2
    for row in twins.values():
        assert len({c["peak_mem_bytes"] for c in row.values()}) == 1
        assert all(c["tokens_per_s"] <= row[0]["tokens_per_s"] for c in row.values())
    assert counted and not any(key.options.get("kv_bucket") for key in counted)
    # the table shows both; a user's choice is kept
    rc, out, _ = plan_cli(capsys, "--model", "7b", "--hardware", "mi300x", "--seq-len", 131072,
                          "--gpus", 8, "--mlp-schedule", "ring", "--top", 30,
                          "--cache", tmp_path)  # fmt: skip
    rows = table_rows(out)
    assert {r[7] for r in rows if r[1].startswith("tsp")} == {"ring"} and "best plan:" in out


def test_a_cold_plan_for_1024_gpus_counts_few_configurations(counted):
    """The cold path's cost is the configurations counted (each a few seconds: the per-count
    budget is in test_op_count.py) times their count: a cold 7B plan at 128K on 1024 GPUs
    counts the rows it shows, not its 92 configurations or their KV buckets."""
    p = search.plan(Request.make("7b", "mi300x", 131072, 1024), use_cache=False)
    assert len(p.configs) >= 90 and p.ops.counted == len(counted) <= 16
    assert not any(key.options.get("kv_bucket") for key in counted)


@pytest.mark.parametrize("strategy", ["tsp", "fsdp_cp", "tp"])
def test_a_bound_recharged_with_the_operations_is_their_projection(strategy):
    """The plan charges counted operations to a configuration's bound (``costmodel.recharge``)
    instead of projecting each micro-batch again: the same numbers."""
    spec = RunSpec.make(strategy, PRESETS["7b"], degree=8, dp=4, seq_len=65536, batch=2,
                        dtype="bf16", recompute="full")  # fmt: skip
    preset = costmodel.load_preset("h100")
    again = costmodel.recharge(costmodel.project(spec, preset, ops=0), 12345)
    exact = costmodel.project(spec, preset, ops=12345)
    assert again.keys() == exact.keys() and again["dispatch_s"] > 0
    assert all(again[k] == pytest.approx(v, rel=1e-12) for k, v in exact.items())


def test_counts_operations_for_real_and_caches_them(tmp_path):
    req = Request.make("tiny", "mi300x", 256, 2, mode="infer", dtype="fp32", max_batch=2)
    first = search.plan(req, top=1, cache=tmp_path)
    assert first.ops.counted > 0 and all(r.cand.exact for r in first.shown if r.fits)
    again = search.plan(req, top=1, cache=tmp_path)
    assert again.ops.counted == 0 and again.ops.hits == first.ops.counted
    assert again.best.cand.tokens_per_s == first.best.cand.tokens_per_s


def test_estimate_rechecks_the_best_rows(capsys, counted, tmp_path):
    argv = ["--model", "tiny", "--seq-len", 256, "--gpus", 4, "--dtype", "fp32",
            "--max-batch", 2, "--estimate", "--estimate-top", 1, "--kernel", "cpu_flash",
            "--cache", tmp_path]  # fmt: skip
    rc, out, _ = plan_cli(capsys, *argv)
    assert rc == 0 and "estimator:" in out and "cached" not in out.split("estimator:")[1]
    rc, out, _ = plan_cli(capsys, *argv)
    assert "cached" in out.split("estimator:")[1].splitlines()[0]


def test_map_sweep_and_figures(counted, tmp_path):
    cfg_path = tmp_path / "plan.yaml"
    cfg_path.write_text(
        "name: t\nmaps: [{model: 7b, hardware: mi300x}]\nseq_lens: [65536, 1048576]\n"
        "gpus: [8, 16]\nmax_batch: 2\n"
    )
    cfg = load_config(cfg_path)
    table = sweep(cfg, "7b", "mi300x", cache=tmp_path)
    assert len(table) == 2 * 2 * 7 and table.fits.any()
    s64 = table[(table.seq_len == 65536) & (table.gpus == 8)]
    assert s64.winner.iloc[0] is not None and s64.focus_margin.notna().all()
    write_map(table, cfg, "7b", "mi300x", tmp_path / "out")
    for name in ("winner", "feasible", "margin"):
        assert (tmp_path / "out" / f"{name}.png").stat().st_size > 10_000
        assert (tmp_path / "out" / f"{name}.pdf").exists()
    assert (tmp_path / "out" / "map.csv").read_text().startswith("model,hardware,seq_len")


@pytest.mark.parametrize(
    "text, needle",
    [
        ("maps: [{model: 7b, hardware: mi300x}]\nseq_lens: [2.0]\ngpus: [8]\n", "seq_lens"),
        ("maps: [{model: 70b, hardware: mi300x}]\nseq_lens: [8]\ngpus: [8]\n", "maps.0.model"),
        ("maps: []\nseq_lens: [8]\ngpus: [8]\n", "maps"),
        ("maps: [{model: 7b, hardware: mi300x}]\nseq_lens: [8]\ngpus: [8]\nx: 1\n", "'x' was"),
    ],
)
def test_map_config_refused_naming_the_key(tmp_path, text, needle):
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(path)


def test_spearman_ranks_with_ties():
    assert check.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert check.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert check.spearman([1, 1, 2], [5, 5, 9]) == pytest.approx(1.0)


def test_plan_check_compares_each_analytic_peak_with_the_same_step(counted, tmp_path):
    """A record's peak_mem_bytes is the steady state and peak_mem_bytes_first_step the first
    step's: where the measured peaks are the analytic ones, the check reports no error for
    either (it once set the analytic first step against the measured steady state)."""
    import pandas as pd

    from tspbench.projection import analytic

    ref = "results/reference"
    rows = pd.read_csv(f"{ref}/calibration/default-summary-1.csv")
    rows = rows[rows["mode"] == "train"].head(4).copy()
    for i, row in rows.iterrows():
        mem = analytic.memory(costmodel.case_of_row(row.to_dict()))
        rows.loc[i, "peak_mem_bytes"] = mem["peak"]
        rows.loc[i, "peak_mem_bytes_first_step"] = mem["peak_first"]
    assert (rows["peak_mem_bytes"] != rows["peak_mem_bytes_first_step"]).any()
    summary = tmp_path / "summary.csv"
    rows.to_csv(summary, index=False)
    text = check.check([str(summary)], f"{ref}/calibration/cpu-2c.json",
                           f"{ref}/projected-7b/memory.csv", cache=str(tmp_path))  # fmt: skip
    assert "steady state median 0.0%, max 0.0%; first step median 0.0%, max 0.0%" in text


def test_the_best_plan_is_weighed_against_another_strategy_over_the_rate_ranges(
    capsys, counted, tmp_path
):
    """The best plan's margin over the best plan of another strategy, at the nominal rates and
    at both ends of the preset's rate_ranges: a tie where the order flips, said in the text."""
    from tspbench.projection import costmodel as cm

    rc, out, _ = plan_cli(capsys, "--model", "7b", "--hardware", "h100", "--seq-len", 65536,
                          "--gpus", 8, "--cache", tmp_path, "--json")  # fmt: skip
    got = json.loads(out)["best"]["contest"]
    assert (
        rc == 0 and got["rival"] and got["rival"].split()[0] != json.loads(out)["best"]["strategy"]
    )
    lo, hi = got["margin_range"]
    assert lo <= got["margin"] <= hi and got["tie"] == (lo <= 0)
    fast, slow = cm.corners(cm.load_preset("h100"))
    assert fast["attention_efficiency"] == 0.35 and slow["op_overhead_s"] == 4.9e-05
    rc, out, _ = plan_cli(capsys, "--model", "7b", "--hardware", "h100", "--seq-len", 65536,
                          "--gpus", 8, "--cache", tmp_path)  # fmt: skip
    assert f"against {got['rival']}: {got['margin']:+.1%} projected" in out


LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}  # fmt: skip


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_rope_scaling_is_read_as_transformers_4_and_5_write_it(key):
    """transformers 4 writes ``rope_scaling`` (and ``type`` in older files), 5
    ``rope_parameters`` with ``rope_theta`` inside: both give the same model, scaling modelled."""
    extra = {"rope_theta": 5e5} if key == "rope_parameters" else {}
    data = {k: v for k, v in LLAMA3_8B.items() if not (extra and k == "rope_theta")}
    cfg, notes = hf_config({**data, key: {**LLAMA31, **extra}})
    assert not {"rope_scaling", "rope_parameters"} & noted(notes) and cfg.rope_theta == 5e5
    assert cfg.rope_scaling == (
        "llama3,factor=8,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=8192"
    )
    cfg, _ = hf_config({**LLAMA3_8B, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert cfg.rope_scaling == "linear,factor=2"


@pytest.mark.parametrize(
    "scaling, needle",
    [
        ({"factor": 8.0}, "rope_scaling: factor: a parameter of no scaling (rope_type default)"),
        ({"rope_type": "dynamic", "factor": 2.0}, "rope_type='dynamic': dynamic NTK scaling"),
        ({"rope_type": "longrope"}, "rope_type='longrope': LongRoPE"),
        (
            {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 4096,
                "mscale": 0.7,
            },
            "mscale=0.7: not modelled for rope_type yarn",
        ),  # fmt: skip
        ({**LLAMA31, "factor": 0.5}, "factor=0.5: must be >= 1"),
        ({"rope_type": "llama3", "factor": 8.0}, "llama3 needs low_freq_factor"),
        ({"rope_type": "linear", "factor": "2"}, "factor='2': must be a number"),
        ({"rope_type": "wavy"}, "rope_type='wavy': unknown"),
        ([1], "rope_scaling=[1]: must be an object"),
    ],
)
def test_a_scaling_not_modelled_is_refused_naming_the_key(scaling, needle):
    with pytest.raises(ConfigError) as e:
        hf_config({**LLAMA3_8B, "rope_scaling": scaling})
    assert needle in str(e.value) and "\n" not in str(e.value)


def llama_or_mistral_qk(got: dict) -> bool:
    return any(cfg.qk_norm for name, (cfg, _) in got.items() if not name.startswith("qwen3"))


def qwen_bias_elsewhere(got: dict) -> bool:
    return any(cfg.qkv_bias for name, (cfg, _) in got.items() if not name.startswith("qwen2"))


def test_published_model_files_plan(capsys, counted, tmp_path):
    """Each committed config.json (workflows/models/, sources in its README) is read whole:
    no key refused, its scaling modelled, the values as published."""
    from pathlib import Path

    from tspbench.core.config import read_hf_config

    models = Path(__file__).parents[2] / "workflows" / "models"
    got = {p.stem: read_hf_config(str(p)) for p in sorted(models.glob("*.json"))}
    assert {"llama3.1-8b", "llama3.2-1b", "mistral-7b-v0.3", "qwen2.5-7b", "qwen3-8b",
            "qwen3-4b"} <= set(got)  # fmt: skip
    small, _ = got["llama3.2-1b"]
    tied = [n for n, (c, _) in got.items() if c.tie_embeddings]
    assert small.tie_embeddings and tied == ["llama3.2-1b", "qwen3-4b"]
    # Qwen3 4B: 32 heads of 128 for h = 2560, so Q and W_o's input are 4096 wide
    q4, _ = got["qwen3-4b"]
    assert q4.qk_norm and q4.head_dim == 128 and q4.q_dim == 4096 and q4.hidden == 2560
    assert round(q4.n_params() / 1e9, 1) == 4.0  # "Number of Parameters: 4.0B" (model card)
    assert round(q4.n_params(embeddings=False) / 1e9, 1) == 3.6  # "(Non-Embedding): 3.6B"
    assert round(small.n_params() / 1e9, 2) == 1.24  # "1.23B" (model card), the tie counted once
    q25, _ = got["qwen2.5-7b"]
    assert q25.qkv_bias and not q25.qk_norm and not qwen_bias_elsewhere(got)
    assert round(q25.n_params() / 1e9, 2) == 7.62  # "Number of Parameters: 7.61B" (model card)
    assert all(noted(notes) <= {"torch_dtype", "max_position_embeddings"}
               for name, (_, notes) in got.items() if name != "mixtral-8x7b-v0.1")  # fmt: skip
    mixtral, notes = got["mixtral-8x7b-v0.1"]  # (its load-balancing loss off, as HF's default)
    assert noted(notes) == {"torch_dtype", "max_position_embeddings", "router_aux_loss_coef"}
    assert (mixtral.experts, mixtral.top_k, mixtral.moe_ffn, mixtral.kv_heads) == (8, 2, 14336, 8)
    assert round(mixtral.n_params() / 1e9, 1) == 46.7  # "46.7B total parameters" (Mistral AI)
    idle = mixtral.layers * (mixtral.experts - mixtral.top_k) * 3 * mixtral.hidden * mixtral.moe_ffn
    assert round((mixtral.n_params() - idle) / 1e9, 1) == 12.9  # "12.9B active parameters"
    qwen, _ = got["qwen3-8b"]
    assert qwen.qk_norm and not llama_or_mistral_qk(got)
    assert round(qwen.n_params() / 1e9, 2) == 8.19  # "Number of Parameters: 8.2B" (model card)
    llama, _ = got["llama3.1-8b"]
    assert (llama.hidden, llama.layers, llama.kv_heads, llama.ffn, llama.vocab) == (
        4096, 32, 8, 14336, 128256)  # fmt: skip
    assert llama.rope_scaling.startswith("llama3,factor=8,") and llama.rope_theta == 5e5
    rc, out, _ = plan_cli(capsys, "--model", str(models / "llama3.1-8b.json"), "--hardware",
                          "h100", "--seq-len", 32768, "--gpus", 8, "--cache", tmp_path)  # fmt: skip
    assert rc == 0 and "best plan:" in out and "--set rope_scaling=llama3," in out
    # with experts: only the strategies that run them, TSP's expert schedules searched
    rc, out, _ = plan_cli(capsys, "--model", str(models / "mixtral-8x7b-v0.1.json"),
                          "--hardware", "h200", "--seq-len", 32768, "--gpus", 8, "--cache",
                          tmp_path)  # fmt: skip
    best = next(line for line in out.splitlines() if line.startswith("best plan:"))
    assert rc == 0 and "--set experts=8 --set top_k=2" in out
    header = next(line for line in out.splitlines() if line.startswith(" #  strategy"))
    assert best.split()[2] in {"tsp", "tp", "fsdp_cp"} and " moe " in header
    assert "runs dense models only" in out  # (the others' groups, filtered with the reason)


def test_the_margin_map_says_where_one_side_recomputes(tmp_path, monkeypatch):
    """Issue 36: the MI300X margin map's column of +23% (+25% with TSP's K/V ring) at 256K was
    unexplained. Drawn from the committed map, those cells say that only the other side
    recomputes there (FSDP+CP's best plan at 256K recomputes, TSP's does not: docs/planning.md
    has the memory), and no cell where both sides do the same says anything."""
    import pandas as pd

    from tests.helpers.runner import ROOT
    from tspbench.projection.plan import figures

    table = pd.read_csv(ROOT / "results/reference/plan/7b-mi300x/map.csv")
    cfg = {"seq_lens": sorted(table.seq_len.unique()), "gpus": sorted(table.gpus.unique()),
           "focus": "tsp"}  # fmt: skip
    cells = table.drop_duplicates(["seq_len", "gpus"]).set_index(["seq_len", "gpus"])
    drawn = {}
    monkeypatch.setattr(figures, "_save", lambda fig, out, name: drawn.setdefault(name, fig))
    figures._margin_figure(table, cells, cfg, "7b on mi300x", tmp_path)
    texts = {(round(t.get_position()[0]), round(t.get_position()[1])): t.get_text()
             for t in drawn["margin"].axes[0].texts}  # fmt: skip
    col = cfg["seq_lens"].index(262144)
    marked = {j for (j, _), text in texts.items() if "other rc" in text}
    assert marked == {col}, texts
    margin = cells.loc[262144].focus_margin  # the map's own (+25.3% with TSP's K/V ring)
    assert (margin > 1.2).all()
    assert all(texts[(col, i)].startswith(f"{m - 1:+.1%}") for i, m in enumerate(margin))
    note = drawn["margin"].texts[0].get_text()
    assert "other rc: the best other strategy's best plan recomputes" in note
