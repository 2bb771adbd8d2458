"""The paper's claims table: made from the committed references in seconds, every claim of
tspbench/data/claims.yaml answered, and a throughput claim above what the hardware's peak
FLOP rate allows is called out as such."""

from __future__ import annotations

import time

import pandas as pd
import pytest
import yaml

from tests.helpers.runner import ROOT
from tspbench.core.config import get_config
from tspbench.pipeline.claims import CLAIMS, Sources, claims_table

REFS = Sources(ROOT / "results/reference/projected-7b",
               ROOT / "results/reference/calibration/default-summary-1.csv")  # fmt: skip
# "projected: ...": a claim only our projection answers (no 7B measured on 8 GPUs yet)
VERDICTS = {"holds", "partly", "differs", "not checkable here", "projected: holds",
            "projected: partly"}  # fmt: skip


def test_the_table_answers_every_claim_from_the_references_in_seconds(tmp_path, monkeypatch):
    from tspbench.cli import main

    monkeypatch.chdir(ROOT)  # the default sources lie under the current directory
    t0 = time.monotonic()
    assert main(["claims", "--out", str(tmp_path / "c.csv"), "--md", str(tmp_path / "c.md")]) == 0
    assert time.monotonic() - t0 < 30
    df = pd.read_csv(tmp_path / "c.csv")
    assert list(df.columns[:5]) == ["claim", "paper", "ours", "verdict", "reason"]
    assert set(df["verdict"]) <= VERDICTS and df["ours"].notna().all()
    spec = yaml.safe_load(CLAIMS.read_text())
    for c in spec["claims"]:
        assert df["claim"].str.startswith(c["claim"]).any(), c["claim"]


def test_173m_tokens_per_s_is_above_the_physical_bound():
    """173M tokens/s on 1024 MI300X at 128K: a forward pass of the 7B model costs 2N + causal
    attention FLOPs per token; at 100% of the dense bf16 peak the GPUs cannot exceed that."""
    cfg = get_config("7b")
    n = cfg.n_params(embeddings=False) + cfg.vocab * cfg.hidden
    per_token = 2 * n + 2 * cfg.layers * 131072 * cfg.hidden
    bound = 1024 * 1.3074e15 / per_token
    assert 20e6 < bound < 173e6 / 5  # the claim is more than 5x what the peak allows
    df = claims_table(src=REFS)
    claim = "Tokens/s on 1024 MI300X, 128K, D = 8 per model copy (mainly forward)"
    row = df[df["claim"] == f"Physical bound for: {claim}"]
    assert len(row) == 1 and row.iloc[0]["verdict"] == "differs"
    assert f"at most {bound / 1e6:.1f}M tokens/s" == row.iloc[0]["ours"]


def test_forward_crossover_is_near_8h_and_training_crossovers_are_stated():
    df = claims_table(src=REFS).set_index("claim")
    fwd = df.loc["TSP's forward traffic falls below TP's when B x S exceeds about 8h"]
    assert fwd["verdict"] == "holds"
    for rc in ("none", "full"):
        row = df.loc[f"Training crossover (recompute {rc}): TSP moves fewer bytes than TP"]
        assert row["ours"].startswith("B x S > ")


def test_the_kinds_of_the_schema_are_the_checks():
    from tspbench.pipeline.claims import CHECKS, SCHEMA
    from tspbench.runtime.registry import schema as packaged

    schema = packaged(SCHEMA)
    kinds = schema["properties"]["claims"]["items"]["properties"]["kind"]["enum"]
    assert sorted(kinds) == sorted(CHECKS)


def _claim(spec: dict, cid: str) -> dict:
    return next(c for c in spec["claims"] if c["id"] == cid)


BAD_CLAIMS = [
    ("subject", lambda s: s.pop("subject"), "(top level): 'subject' is a required property"),
    ("unknown", lambda s: s.update(subject="megatron"), "subject: 'megatron' is not one of"),
    (
        "versus",
        lambda s: _claim(s, "forward-crossover").pop("versus"),
        "claims.12: 'versus' is a required",
    ),  # fmt: skip
    (
        "gpu_counts",
        lambda s: _claim(s, "pipeline-composition-h100").pop("gpu_counts"),
        "'gpu_counts' is a required property",
    ),  # fmt: skip
    ("kind", lambda s: s["claims"][0].update(kind="speed"), "claims.0.kind: 'speed' is not one"),
    ("nan", lambda s: s["claims"][0].update(paper_gb=[float("nan")]), "is not a finite number"),
]


@pytest.mark.parametrize(
    "change, needle", [b[1:] for b in BAD_CLAIMS], ids=[b[0] for b in BAD_CLAIMS]
)
def test_a_bad_claims_file_exits_2_in_one_line_naming_the_field(tmp_path, capsys, change, needle):
    from tspbench.cli import main

    spec = yaml.safe_load(CLAIMS.read_text())
    change(spec)
    path = tmp_path / "claims.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["claims", "--claims", str(path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def test_the_subject_is_the_claims_files_own(tmp_path):
    """The strategy the claims are about is data: each strategy that beats the subject in a
    (length, recompute) cell is set against the file's subject, whichever it is."""
    spec = yaml.safe_load(CLAIMS.read_text())
    lowest = next(c for c in spec["claims"] if c["kind"] == "lowest_memory")
    path = tmp_path / "claims.yaml"
    for subject, other in (("tsp", "tp"), ("tp", "tsp")):
        path.write_text(yaml.safe_dump({**spec, "subject": subject, "claims": [lowest]}))
        reason = claims_table(path, REFS).iloc[0]["reason"]
        # (TSP's projected losses to FSDP+CP at 16K-32K with recompute are within 0.5%: ties)
        beaten = f"< {subject} " in reason or f"{subject} ties " in reason
        assert beaten and f"< {other} " not in reason, reason


def test_every_claim_runs_with_another_subject(tmp_path):
    """No check assumes the subject is TSP: with ``subject: tp`` every claim still gives a row
    (TP has no K/V backward choice, so its memory rows carry no design-choice note)."""
    spec = yaml.safe_load(CLAIMS.read_text())
    path = tmp_path / "claims.yaml"
    path.write_text(yaml.safe_dump({**spec, "subject": "tp"}))
    table = claims_table(path, REFS)
    assert len(table) >= len(spec["claims"])
    assert not table["reason"].str.contains("--kv-backward").any()


def test_claims_schema_enums_are_the_registries():
    from tspbench.core.config import PRESETS
    from tspbench.runtime.registry import schema as packaged
    from tspbench.runtime.registry import strategies

    schema = packaged("claims.schema.yaml")
    assert schema["$defs"]["strategy"]["enum"] == list(strategies())
    assert schema["properties"]["model"]["enum"] == list(PRESETS)


def test_competitive_throughput_is_judged_against_the_best_alternative():
    """'Competitive with TP+SP, and better with longer sequences' (issue 29): TSP's forward
    tokens/s per GPU over the best of every other layout at each length, not only TP+SP's (on
    the MI300X references SP is the best alternative at every length), each length naming it,
    TP+SP's ratios beside; competitive (above 0.8 everywhere) and rising make 'holds', one of
    the two 'partly', as a projection."""
    df = claims_table(src=REFS).set_index("claim")
    row = df.loc[
        "Throughput is competitive with TP+SP, and better with longer sequences and larger D"
    ]
    per_s = row["ours"].split("(PROJECTED): ")[1].split(";")[0].split(", ")
    ratios = [float(x.split()[1]) for x in per_s]
    assert all("(" in x for x in per_s)  # each length names its best alternative
    assert "TSP / best TP+SP: {" in row["ours"]
    halves = (min(ratios) > 0.8) + (ratios == sorted(ratios))
    assert row["verdict"] == {2: "projected: holds", 1: "projected: partly", 0: "differs"}[halves]


def test_the_micro_batch_claim_is_judged_by_the_largest_batch_that_fits():
    """Issue 29: every strategy fit every micro-batch of the projected sweep (1-16), yet the row
    said 'holds'. Judged by the largest micro-batch each layout fits in an MI300X's usable
    memory (analytic peak, a search), TSP's is the largest by a margin."""
    from tspbench.pipeline.claim_projected import largest_batch

    assert largest_batch(lambda B: 10 * B, 95) == 9 and largest_batch(lambda B: 10 * B, 5) == 0
    assert largest_batch(lambda B: B, 10**9, hi=64) == 64
    row = (
        claims_table(src=REFS).set_index("claim").loc["Smaller memory admits larger micro-batches"]
    )
    fits = dict(
        x.rsplit(" ", 1) for x in row["ours"].split("PROJECTED): ")[1].replace(";", ",").split(", ")
    )
    ours = int(fits.pop("TSP"))
    assert ours > max(int(v) for v in fits.values()) > 0
    assert row["verdict"] == "projected: holds"


def test_peaks_within_half_a_percent_are_a_tie():
    """At 16K with recompute full TSP and TP differ by 0.03% in the estimate: a tie, not a win."""
    from tspbench.pipeline.labels import tied

    assert tied(100.0, 100.03) and tied(100.03, 100.0) and tied(100.0, 100.5)
    assert not tied(100.0, 101.0) and not tied(101.0, 100.0)


def test_measured_cells_of_several_degrees_and_sweeps_are_compared_like_with_like(tmp_path):
    """The Slurm test's sweep (seq: TSP and TP at D = 2, S = 64; 'four': TSP at D = 4, S = 64
    and 128) made `tspbench claims` crash (exit 1, CI): TSP twice at S = 64 once sweeps were
    read by what they vary. Cells are compared per length, degree, GPU count and batch."""
    from tests.helpers.records import CPU, summary
    from tspbench.pipeline.claims import claims_table

    def sweep(name, strategies, D, lengths):
        return {"name": name, "strategies": strategies, "degrees": [D], "gpus": [D],
                "seq_lens": lengths, "batches": [1], "modes": ["train"]}  # fmt: skip

    cfg = {"name": "mixed", "model": "tiny", "dtype": "fp32", "warmup": 0, "steps": 1,
           "gpus_per_node": 4, "launcher": "local",
           "sweeps": [sweep("seq", ["tsp", "tp"], 2, [64]),
                      sweep("four", ["tsp"], 4, [64, 128])]}  # fmt: skip
    _, df = summary(cfg, tmp_path, launcher="local", hardware=CPU)
    df.to_csv(tmp_path / "summary.csv", index=False)
    table = claims_table(src=Sources(REFS.projected, tmp_path / "summary.csv"))
    row = table.set_index("claim").loc[
        "TSP has the lowest peak memory per GPU at every length from 16K to 128K"
    ]
    assert "measured on this CPU" in row["ours"]


def _pipeline_sources(tmp_path, loss_tsp_pp: float, fits: bool) -> Sources:
    """A measured summary with the pipeline sweep's four cells (TSP and TP, D = 2, with and
    without two stages) and a plan map whose cells have (or lack) a TSP pipeline."""
    base = {"sweep": "pipeline", "status": "ok", "degree": 2, "seq_len": 512, "global_batch": 4,
            "mode": "train", "batch": 4, "grad_norm": 2.0, "peak_mem_bytes": 2**20}  # fmt: skip
    rows = []
    for s in ("tsp", "tp"):
        rows.append(base | {"cell": f"{s}.flat", "strategy": s, "label": s, "gpus": 2,
                            "loss": 5.0})  # fmt: skip
        loss = loss_tsp_pp if s == "tsp" else 5.0  # (TP's pair is shown, TSP's judges)
        rows.append(base | {"cell": f"{s}.pp", "strategy": s, "label": s, "gpus": 4, "pp": 2,
                            "loss": loss})  # fmt: skip
    pd.DataFrame(rows).to_csv(tmp_path / "summary.csv", index=False)
    cells = []
    for S in (32768, 131072):
        for G in (64, 256, 1024):
            pp = {"focus_pp_label": "tsp x PP2 1f1b", "focus_pp_degree": 8,
                  "focus_pp_tokens_per_s": 2.0, "no_pp_label": "fsdp_cp", "pp_ratio": 1.1,
                  "pp_ratio_low": 1.0, "pp_ratio_high": 1.2,
                  "rival_pp_label": "fsdp_cp x PP2 1f1b", "rival_pp_tokens_per_s": 2.5,
                  "pp_rival_ratio": 0.8}  # fmt: skip
            if not fits and G == 1024:
                pp = {k: None for k in pp}
            cells.append({"seq_len": S, "gpus": G, "strategy": "tsp"} | pp)
    (tmp_path / "7b-mi300x").mkdir()
    pd.DataFrame(cells).to_csv(tmp_path / "7b-mi300x/map.csv", index=False)
    return Sources(REFS.projected, tmp_path / "summary.csv", tmp_path)


@pytest.mark.parametrize(
    "loss, fits, verdict",
    [(5.0, True, "holds"), (5.0 * (1 + 1e-3), True, "differs"), (5.0, False, "partly")],
)
def test_the_pipeline_row_is_judged_by_equality_and_by_fitting(tmp_path, loss, fits, verdict):
    from tspbench.pipeline.claim_projected import pipeline_rows

    spec = yaml.safe_load(CLAIMS.read_text())
    c = next(c for c in spec["claims"] if c["kind"] == "pipeline" and c["hardware"] == "mi300x")
    src = _pipeline_sources(tmp_path, loss, fits)
    (row,) = pipeline_rows({**c, "subject": "tsp"}, get_config("7b"), src)
    assert row.verdict == verdict, row.ours
    assert (
        "2 pipelined cells" in row.ours
        and "32K G=64: tsp x PP2 1f1b D=8 / fsdp_cp 1.10 (1.00-1.20); / fsdp_cp x PP2 1f1b 0.80"
        in row.ours
    )
    # without pipelined cells in the summary, only the projection answers
    pd.read_csv(src.measured).query("cell.str.endswith('flat')").to_csv(src.measured, index=False)
    (row,) = pipeline_rows({**c, "subject": "tsp"}, get_config("7b"), src)
    assert row.verdict == ("projected: holds" if fits else "partly")


def _experts_summary(tmp_path, loss_tp: float, tsp_peak: int) -> Sources:
    """A measured summary with a moe cell set at one length: TSP's two schedules, TP and
    FSDP+CP (peaks 3 and 4 MiB), and a dense cell the row must not read."""
    base = {"sweep": "moe", "status": "ok", "degree": 4, "seq_len": 512, "mode": "train",
            "batch": 1, "gpus": 4, "experts": 8, "grad_norm": 2.0, "loss": 5.0}  # fmt: skip

    def run(cell: str, strategy: str, label: str, peak: int, **kw) -> dict:
        return base | {"cell": cell, "strategy": strategy, "label": label,
                       "peak_mem_bytes": peak, **kw}  # fmt: skip

    rows = [
        run("tsp", "tsp", "tsp", 5 * 2**20),
        run("tsp-ring", "tsp", "tsp (ring experts)", tsp_peak),
        run("tp", "tp", "tp", 3 * 2**20, loss=loss_tp),
        run("fsdp", "fsdp_cp", "fsdp_cp", 4 * 2**20),
        run("dense", "tsp", "tsp", 1, sweep="seq", experts=0, loss=9.0),
    ]
    pd.DataFrame(rows).to_csv(tmp_path / "summary.csv", index=False)
    return Sources(REFS.projected, tmp_path / "summary.csv", tmp_path)


@pytest.mark.parametrize(
    "loss_tp, tsp_peak, ahead, verdict, shown",
    [
        (5.0, 2**20, True, "holds", "tsp (ring experts) 1.00 MiB/rank / TP 0.33, / FSDP+CP 0.25"),
        (5.0, 2**20, False, "partly", "tsp (ring experts) 1.00 MiB/rank / TP 0.33"),
        (5.0 * (1 + 1e-3), 2**20, True, "differs", "4 runs NOT equal"),
        (5.0, 7 * 2**20, True, "partly", "tsp 5.00 MiB/rank / TP 1.67, / FSDP+CP 1.25"),
        (5.0, 7 * 2**20, False, "differs", "tsp 5.00 MiB/rank / TP 1.67, / FSDP+CP 1.25"),
    ],
)  # fmt: skip
def test_the_experts_row_is_judged_by_equality_and_by_memory(
    tmp_path, monkeypatch, loss_tp, tsp_peak, ahead, verdict, shown
):
    """Equal runs and a TSP schedule leaner than TP + EP and FSDP+CP + EP, measured and
    projected at Mixtral 8x7B's size: holds; leaner in one of them: partly; a loss off by 1e-3,
    or heavier in both: differs; the dense cell of another sweep is not read; no cell with
    experts: not checkable (the projection still said)."""
    from tspbench.pipeline import moe_claims

    spec = yaml.safe_load(CLAIMS.read_text())
    c = next(c for c in spec["claims"] if c["kind"] == "experts")
    real = moe_claims.projected_experts({**c, "subject": "tsp"})
    assert real[1] and "tsp (ring experts) against each rival 0.74, 0.87" in real[0], real
    monkeypatch.setattr(moe_claims, "projected_experts", lambda c: (real[0], ahead))
    src = _experts_summary(tmp_path, loss_tp, tsp_peak)
    (row,) = moe_claims.experts_rows({**c, "subject": "tsp"}, get_config("tiny"), src)
    assert row.verdict == verdict and shown in row.ours, row.ours
    assert (
        "4 cells with experts" in row.ours and "projected (mixtral-8x7b-v0.1, S=32768" in row.ours
    )
    pd.read_csv(src.measured).query("experts == 0").to_csv(src.measured, index=False)
    (row,) = moe_claims.experts_rows({**c, "subject": "tsp"}, get_config("tiny"), src)
    assert row.verdict == "not checkable here" and "projected (" in row.ours
