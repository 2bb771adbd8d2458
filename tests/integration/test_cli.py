"""`tspbench run`: every strategy through the CLI agrees with the reference; torchrun, mpiexec
and the local launcher write the same record; infer mode, a forced OOM, bad arguments, and a FIFO
where a record should be."""

from __future__ import annotations

import json
import os
import sys

import jsonschema
import pytest

from tests.helpers.records import written_keys
from tests.helpers.runner import tool, tspbench
from tspbench.core import attention
from tspbench.runtime.registry import schema

BASE = ["--model", "tiny", "--seq-len", "32", "--warmup", "0", "--steps", "1", "--quiet"]
SCHEMA = schema("record.schema.json")
# every strategy on the same global batch of 4 sequences, on 2 ranks (TP+SP on 2 x 2, TSP on
# 4 as well): the CLI path, not the degrees (tests/integration/test_equivalence.py has those)
RUNS = {
    "single": ["--strategy", "single", "--batch", "4"],
    "single-dp2": ["--strategy", "single", "--batch", "2", "--dp", "2"],
    "tsp": ["--strategy", "tsp", "--degree", "4", "--batch", "4"],
    "dp": ["--strategy", "dp", "--degree", "2", "--batch", "4"],
    "tp": ["--strategy", "tp", "--degree", "2", "--batch", "4"],
    "sp": ["--strategy", "sp", "--degree", "2", "--batch", "4"],
    "tpsp": ["--strategy", "tpsp", "--tp", "2", "--sp", "2", "--batch", "4"],
    "fsdp_cp": ["--strategy", "fsdp_cp", "--degree", "2", "--batch", "4"],
    "fsdp2_cp": ["--strategy", "fsdp2_cp", "--degree", "2", "--batch", "4"],
    # SP with the ring; FSDP+CP with DeepSpeed-Ulysses' all-to-alls (DeepSpeed's long-context
    # recipe, ZeRO-3 + Ulysses); Megatron-Core's hierarchical exchange: the all-to-all in
    # pairs, the ring across them
    "sp-ring": ["--strategy", "sp", "--degree", "2", "--batch", "4", "--cp-comm", "ring"],
    "fsdp_cp-a2a": ["--strategy", "fsdp_cp", "--degree", "2", "--batch", "4", "--cp-comm", "a2a"],
    "sp-a2a+p2p": ["--strategy", "sp", "--degree", "4", "--batch", "4", "--cp-comm", "a2a+p2p"],
}
WORLD = {"single": 1, "tsp": 4, "tpsp": 4, "sp-a2a+p2p": 4}  # the others: 2
# a pipelined run's arguments (two stages of TSP on 2 ranks each), for the bad-input cases
PP = ["--strategy", "tsp", "--seq-len", "32", "--degree", "2", "--batch", "2", "--pp", "2",
      "--microbatches", "2"]  # fmt: skip


# The runs read the model from a Hugging Face config.json, as a user's would: the tiny preset's
# shapes as a small Qwen3 (QK norms, tied embeddings and heads twice hidden/heads wide, as Qwen3
# 0.6B's) with Llama 3.1's RoPE scaling, so every strategy's CLI run checks those features
# against single (docs/models.md)
QWEN3_TINY = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 256,
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 8, "head_dim": 16, "intermediate_size": 128, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": True, "attention_bias": False,
    "sliding_window": None, "use_sliding_window": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
}  # fmt: skip


# ... and a Qwen2 file (QKV biases, untied, YaRN scaling), read by the ranks of a TSP run as by
# single's: every strategy's equality with the reference on that model (and on Llama's and
# Mistral's, which read as the presets) is test_equivalence's, in one process
QWEN2_TINY = {
    **{k: v for k, v in QWEN3_TINY.items() if k != "head_dim"},
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
}  # fmt: skip


def _write(tmp_path_factory, name: str, data: dict):
    path = tmp_path_factory.mktemp("model") / name
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _write(tmp_path_factory, "qwen3-tiny.json", QWEN3_TINY)


@pytest.fixture(scope="module")
def records(tmp_path_factory, model) -> dict[str, dict]:
    return _run_all(tmp_path_factory, model)


@pytest.fixture(scope="module")
def qwen2_records(tmp_path_factory) -> dict[str, dict]:
    path = _write(tmp_path_factory, "qwen2-tiny.json", QWEN2_TINY)
    return _run_all(tmp_path_factory, path, QWEN2_RUNS)


QWEN2_RUNS = ("single", "tsp")


def _run_all(tmp_path_factory, model, names=tuple(RUNS)) -> dict[str, dict]:
    """The runs of RUNS named in ``names`` on the model file ``model``: records by name."""
    d = tmp_path_factory.mktemp("runs")
    out = {}
    for name, args in ((n, RUNS[n]) for n in names):
        world = WORLD.get(name, 2)
        p = tspbench(
            "run",
            *BASE,
            "--warmup",  # the step that splits the peak into its parts
            "1",
            "--model",
            str(model),
            *args,
            "--launch",
            "local",
            "--nproc",
            str(world),
            "--out",
            str(d / f"{name}.json"),
        )
        assert p.returncode == 0, p.stderr[-3000:]
        out[name] = json.loads((d / f"{name}.json").read_text())
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_all_strategies_agree_with_single(records, name):
    ref, rec = records["single"], records[name]
    jsonschema.validate(rec, SCHEMA)
    assert rec["status"] == "ok"
    assert list(rec) == written_keys("train")  # the keys of tspbench.runtime.record_keys, in order
    assert rec["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert rec["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert rec["model"].endswith("qwen3-tiny.json")  # the file as named, which the ranks read
    mc = rec["model_config"]
    assert mc["qk_norm"] and mc["tie_embeddings"] and mc["rope_scaling"] and mc["head_dim"] == 16
    assert rec["global_batch"] == 4 and rec["world_size"] == WORLD.get(name, 2)
    assert rec["tokens_per_s"] > 0 and rec["flops_per_step"] > 0
    assert len(rec["peak_mem_bytes_per_rank"]) == rec["world_size"]
    assert rec["peak_mem_bytes"] == max(rec["peak_mem_bytes_per_rank"])
    if rec["world_size"] > 1:
        assert rec["comm_bytes_total"] > 0


def test_tsp_runs_a_qwen2_file_as_single_does(qwen2_records):
    ref, rec = qwen2_records["single"], qwen2_records["tsp"]
    assert rec["status"] == "ok" and rec["model"].endswith("qwen2-tiny.json")
    assert rec["model_config"]["qkv_bias"] and rec["model_config"]["rope_scaling"][:5] == "yarn,"
    assert not rec["model_config"]["tie_embeddings"]
    assert rec["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert rec["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)


def test_flops_are_the_same_work(records):
    """Every strategy counts the same model FLOPs for the same work, the closed form of the
    model file's step: per layer GEMMs 2t(2h h_q + 2h kv + 3hf) three times (forward, two in
    backward), causal attention 4 B H d S(S+1)/2 (the pairs its mask keeps, for one call over
    S and for zigzag chunks alike) 3.5 times, the LM head 2thV three times. A full mask would
    count 1.9x the attention at D = 1 and less for zigzag chunks; TSP's recomputed loss logits
    are executed, not model, FLOPs."""
    from tspbench.core.config import hf_config

    c, _ = hf_config(QWEN3_TINY)
    B, S = 4, 32
    t = B * S
    gemm = 2 * t * (2 * c.hidden * c.q_dim + 2 * c.hidden * c.kv_dim + 3 * c.hidden * c.ffn)
    attn = 4 * B * c.heads * c.d_head * S * (S + 1) // 2
    want = c.layers * (3 * gemm + 7 * attn // 2) + 3 * 2 * t * c.hidden * c.vocab
    for name, rec in records.items():
        assert rec["flops_counted"] == "model", name
        assert rec["flops_per_step"] == want, name
    for name in (n for n in records if n != "tsp"):  # nothing recomputed but TSP's logits
        assert records[name]["flops_executed_per_step"] == want, name
    assert records["tsp"]["flops_executed_per_step"] == want + 2 * t * c.hidden * c.vocab


LAUNCHERS = {
    "torchrun": ["--standalone", "--nproc-per-node", "2"],
    "mpiexec": ["-n", "2"],
}


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_launchers_give_the_same_record(tmp_path, launcher):
    args = [*BASE, "--strategy", "tsp", "--degree", "2", "--batch", "2"]
    start = [tool(launcher), *LAUNCHERS[launcher]]  # beside sys.executable, not from PATH
    local = tspbench("run", *args, "--launch", "local", "--out", str(tmp_path / "local.json"))
    assert local.returncode == 0, local.stderr[-2000:]
    python = [] if launcher == "torchrun" else [sys.executable]  # torchrun starts Python itself
    p = tspbench("run", *args, "--out", tmp_path / "l.json", launcher=start + python)
    assert p.returncode == 0, p.stderr[-3000:]
    a = json.loads((tmp_path / "local.json").read_text())
    b = json.loads((tmp_path / "l.json").read_text())
    assert b["launcher"] == {"torchrun": "torchrun", "mpiexec": "mpi"}[launcher]
    assert set(a) == set(b)
    for key in (
        "loss",
        "grad_norm",
        "comm_bytes",
        "flops_per_step",
        "param_numel_per_rank",
        "world_size",
        "status",
    ):
        assert a[key] == b[key], key
    # measured memory: equal within a small tolerance (the tracker is repeatable, not exact law)
    assert b["peak_mem_bytes_per_rank"] == pytest.approx(a["peak_mem_bytes_per_rank"], rel=1e-3)


def test_infer_reports_memory_without_grads_or_optimizer(tmp_path, records, model):
    p = tspbench(
        "run",
        *BASE,
        "--model",
        str(model),
        *RUNS["tsp"],
        "--mode",
        "infer",
        "--launch",
        "local",
        "--out",
        str(tmp_path / "i.json"),
    )
    assert p.returncode == 0, p.stderr[-2000:]
    rec = json.loads((tmp_path / "i.json").read_text())
    jsonschema.validate(rec, SCHEMA)
    assert list(rec) == written_keys("infer")
    train = records["tsp"]
    assert rec["grad_norm"] is None and rec["optimizer_numel_per_rank"] == [0] * 4
    assert rec["loss"] == pytest.approx(train["loss"], rel=1e-5)
    assert rec["peak_mem_bytes"] < train["peak_mem_bytes"]
    # forward only: no reduce-scatter / reduce of gradients
    assert "reduce" not in rec["comm_bytes"] and "reduce_scatter" not in rec["comm_bytes"]


def test_forced_oom_is_a_result(tmp_path):
    out = tmp_path / "oom.json"
    p = tspbench(
        "run", *BASE, *RUNS["tsp"], "--launch", "local", "--max-memory", "200K", "--out", str(out)
    )
    assert p.returncode == 0, p.stderr[-2000:]
    rec = json.loads(out.read_text())
    jsonschema.validate(rec, SCHEMA)
    assert rec["status"] == "oom" and "exceed the budget" in rec["error_message"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["--strategy", "tsp", "--seq-len", "30", "--degree", "4"],
            "seq_len=30: must be divisible",
        ),
        (["--strategy", "nope", "--seq-len", "32"], "argument --strategy: invalid choice: 'nope'"),
        (["--strategy", "tsp", "--seq-len", "0"], "argument --seq-len: '0': must be between 1 and"),
        (["--strategy", "tp", "--seq-len", "32", "--degree", "3"], "model.heads=8: must be"),
        (["--strategy", "tsp", "--seq-len", "32", "--set", "bogus=1"], "'bogus': unknown model"),
        (
            [
                "--strategy",
                "tsp",
                "--seq-len",
                "32",
                "--degree",
                "2",
                "--launch",
                "local",
                "--nproc",
                "3",
            ],
            "--nproc=3: must equal degree x dp x pp = 2",
        ),
        (["--strategy", "tsp", "--seq-len", "32", "--degree", "2"], "no launcher environment"),
        (["--strategy", "tsp", "--seq-len", "32", "--max-memory", "lots"], "--max-memory"),
        # a2a+p2p: no inner group below D = 2; an inner size that does not divide D
        (
            ["--strategy", "sp", "--seq-len", "32", "--degree", "2", "--cp-comm", "a2a+p2p"],
            "cp_a2a=0 (the largest that fits): none does; the inner size must divide",
        ),
        (
            [
                "--strategy",
                "fsdp_cp",
                "--seq-len",
                "48",
                "--degree",
                "6",
                "--cp-comm",
                "a2a+p2p",
                "--cp-a2a",
                "4",
            ],
            "cp_a2a=4: must divide the context-parallel degree 6",
        ),  # fmt: skip
        (
            ["--strategy", "sp", "--seq-len", "32", "--degree", "4", "--cp-a2a", "2"],
            "cp_a2a=2: only with cp_comm=a2a+p2p (not all_gather)",
        ),
        # pipelines: stages that do not divide the layers, 1F1B with fewer micro-batches than
        # stages, a schedule torch does not know, one torch knows that is not run here (its
        # V-shaped zero-bubble one), one run here under another name, a zero-bubble schedule
        # for a strategy that does not split its backward, interleaved 1F1B's two stages per
        # rank that do not divide the layers, its unequal rounds, its forward only, a strategy
        # that does not run as a stage yet
        (PP + ["--pp", "4", "--microbatches", "4", "--batch", "4"], "pp=4: must divide model.lay"),
        (PP + ["--microbatches", "1"], "microbatches=1: 1f1b needs at least pp=2"),
        (PP + ["--pp-schedule", "zbv"], "pp_schedule='zbv': must be one of gpipe, 1f1b, inter"),
        (PP + ["--pp-schedule", "ZBVZeroBubble"], "'ZBVZeroBubble' (torch's, but not run here"),
        (
            PP + ["--pp-schedule", "InterleavedZeroBubble"],
            "(torch's ScheduleInterleavedZeroBubble: spelled interleavedzb here)",
        ),
        (
            ["--strategy", "fsdp_cp", *PP[2:-2], "--pp-schedule", "interleavedzb"],
            "pp_schedule=interleavedzb: strategy fsdp_cp does not split its backward",
        ),
        (PP + ["--pp-schedule", "interleaved1f1b"], "pp=2: interleaved1f1b runs 2 stages per "),
        (
            PP[:-1]
            + ["5", "--batch", "5", "--set", "layers=4", "--pp-schedule", "interleaved1f1b"],
            "microbatches=5: interleaved1f1b splits them into microbatches // pp = 2 equal",
        ),
        (
            PP + ["--set", "layers=4", "--pp-schedule", "interleaved1f1b", "--mode", "infer"],
            "pp_schedule=interleaved1f1b: trains only here",
        ),
        (["--strategy", "fsdp2_cp", *PP[2:]], "pp=2: strategy fsdp2_cp does not run as a pip"),
        (PP + ["--mode", "decode"], "mode='decode' with pp=2: pipelines here train or infer"),
        (PP + ["--batch", "3"], "microbatches=2: must divide batch=3"),
        (PP[:-4] + ["--microbatches", "2"], "--microbatches: only with --pp > 1 (got pp=1)"),
        (PP[:-4] + ["--pp-schedule", "gpipe"], "--pp-schedule: only with --pp > 1 (got pp=1)"),
        (
            ["--strategy", "fsdp_cp", *PP[2:-4], "--pp-keep-gathered", "off"],
            "pp_keep_gathered=off: only with pp > 1 (got pp=1)",
        ),  # fmt: skip
    ],
)
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, monkeypatch, args, needle):
    """In-process (no torch import per case): exit 2, one stderr line, no record written."""
    from tspbench.cli import main

    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "bad.json"
    try:
        code = main(["run", *args, "--out", str(out)])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2
    assert len(lines) == 1 and needle in lines[0], err
    assert not out.exists()


def test_overlap_benchmark_reports_every_part(tmp_path):
    """Not a timing test: the benchmark runs and reports the four times and the fractions."""
    out = tmp_path / "ov.json"
    p = tspbench(
        "overlap",
        "--degree",
        "2",
        "--seq-len",
        "64",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--quiet",
        "--launch",
        "local",
        "--out",
        str(out),
    )
    assert p.returncode == 0, p.stderr[-2000:]
    rec = json.loads(out.read_text())
    for key in ("step_overlap_s", "step_no_overlap_s", "compute_s", "comm_s"):
        assert rec[key] > 0, key
    assert rec["collectives_per_step"] > 0 and "hidden_fraction" in rec


def test_records_split_the_peak_into_its_measured_parts(records):
    """Issue 36: what was live at the peak, by part, taken at that crest in the warmup step by
    the tracker that measured the peak: the parts add up to the peak to the byte, for every
    strategy."""
    from tspbench.runtime.measure import PARTS

    for name, rec in records.items():
        parts = rec["peak_parts_bytes"]
        assert list(parts) == list(PARTS), name
        assert sum(parts.values()) == rec["peak_mem_bytes"], (name, parts)
        assert parts["weights"] > 0 and parts["optimizer state"] > 0, (name, parts)


def test_records_say_which_attention_kernel_ran(records):
    """CPU: the zigzag entry point's CPU flash kernel, or PyTorch's SDPA for the plain layer."""
    for name, rec in records.items():
        assert rec["attention_backend"] == "cpu_flash", name  # every strategy's kernel
        assert rec["versions"]["backend"] == "gloo" and "nccl" in rec["versions"]


def test_a_fifo_is_refused_at_once(tmp_path):
    fifo = tmp_path / "rec.json"
    os.mkfifo(fifo)
    p = tspbench("check-record", fifo, timeout=60)  # a blocked read would time out here
    assert p.returncode == 2 and "not a regular file" in p.stderr


def test_doctor_runs_the_cpu_parts_and_fails_on_a_wrong_kernel(tmp_path, monkeypatch, capsys):
    """On a CPU the doctor checks kernels and strategies and skips the GPU checks, saying why;
    a kernel that computes the wrong attention is a FAILED line and exit 1. (Its rank probe,
    most of its time, is checked in this process by test_rank_probe.py and run whole by
    test_gpucheck.py.)"""
    import json

    from tspbench.cli import main
    from tspbench.pipeline import doctor

    monkeypatch.setattr(doctor, "probe_plan", lambda device, found: [])
    assert main(["doctor", "--out", str(tmp_path)]) == 0
    checks = json.loads((tmp_path / "doctor.json").read_text())["checks"]
    status = {c["name"]: c["status"] for c in checks}
    assert status["attention cpu_flash fp32"] == "ok" and status["strategy tsp D=1 on cpu"] == "ok"
    assert sum(s == "ok" for s in status.values()) >= 10
    assert {c["detail"] for c in checks if c["status"] == "skipped"} <= {
        "no GPU visible", "needs 2 GPUs (0 visible)",
        "the single-device reference: D = 8 makes no sense",
    }  # fmt: skip
    real = attention.causal_fwd

    def wrong(q, k, v):
        out, lse = real(q, k, v)
        return out * 1.01, lse

    monkeypatch.setattr(attention, "causal_fwd", wrong)
    assert main(["doctor"]) == 1
    assert "FAILED   attention cpu_flash fp32" in capsys.readouterr().out
