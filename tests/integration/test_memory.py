"""Per-rank peak live tensor bytes of one training step (tiny model, fp32), measured by the
storage tracker, and the qualitative memory claims they must show."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_world
from tspbench.runtime.registry import strategies

SIX = [n for n, s in strategies().items() if not s.reference]  # every strategy on 4 ranks
LENGTHS = (256, 2048)


def _four(s: str) -> dict:
    """The strategy's checked group of 4 ranks, one sequence's worth of work a rank (dp: whole
    sequences, 4 of them: the same global tokens per rank-group as the others)."""
    impl = strategies()[s]
    lay = next(lay for lay in impl.checked_layouts() if lay.degree == 4)
    factors = {k: v for k, v in impl.factors(lay).items() if v is not None}
    return {"D": 4, "B": impl.replica_batch(lay, 1), **factors}


def _cases() -> list[dict]:
    cases = []
    for S in LENGTHS:
        for s in SIX:
            cases.append({"id": f"{s}-{S}", "strategy": s, "S": S, "check": "peak", **_four(s)})
        for D in (1, 2):
            cases.append(
                {"id": f"tsp-D{D}-{S}", "strategy": "tsp", "D": D, "S": S, "B": 1, "check": "peak"}
            )
    # overlap off (overlap is on above), and full recomputation for every strategy
    cases.append(
        {
            "id": "tsp-2048-overlap0",
            "strategy": "tsp",
            "D": 4,
            "S": 2048,
            "B": 1,
            "check": "peak",
            "overlap": False,
        }
    )
    for c in [c for c in cases if c["id"].endswith("-2048") and "-D" not in c["id"]]:
        cases.append({**c, "id": c["id"] + "-recompute", "recompute": "full"})
    return cases


@pytest.fixture(scope="module")
def peaks() -> dict[str, int]:
    ranks = run_world(4, "tests.helpers.checks:run_cases", _cases())
    ids = ranks[0].keys()
    return {k: max(r[k]["peak"] for r in ranks) for k in ids}  # max over ranks


def mib(b: int) -> str:
    return f"{b / 2**20:8.2f}"


def test_tsp_peak_falls_with_degree(peaks, report):
    rows = ["  D " + "".join(f"  S={S:<6}" for S in LENGTHS)]

    def key(D: int, S: int) -> str:
        return f"tsp-D{D}-{S}" if D < 4 else f"tsp-{S}"

    for D in (1, 2, 4):
        rows.append(f"{D:3d} " + "".join(f"{mib(peaks[key(D, S)])}  " for S in LENGTHS))
    report("TSP peak live MiB per rank vs D (tiny model, B=1, fp32, train step)", "\n".join(rows))
    for S in LENGTHS:
        d1, d2, d4 = peaks[f"tsp-D1-{S}"], peaks[f"tsp-D2-{S}"], peaks[f"tsp-{S}"]
        assert d2 < 0.6 * d1 and d4 < 0.6 * d2


def test_six_strategies_at_d4(peaks, report):
    rows = [f"{'strategy':10s}" + "".join(f"  S={S:<6}" for S in LENGTHS) + "   growth"]
    growth = {}
    for s in SIX:
        a, b = (peaks[f"{s}-{S}"] for S in LENGTHS)
        growth[s] = b - a
        rows.append(f"{s:10s}{mib(a)}  {mib(b)}  {mib(b - a)}")
    report(
        "Peak live MiB per rank at D=4 (tiny model, fp32, train step; growth = S x8)",
        "\n".join(rows),
    )
    # TSP divides both model state and activations by D: lowest at both lengths
    for S in LENGTHS:
        assert all(peaks[f"tsp-{S}"] < peaks[f"{s}-{S}"] for s in SIX if s != "tsp")
    # activations: replicated over the group in dp (whole sequences) and tp -> grow fastest
    assert growth["dp"] > 4 * growth["tsp"] and growth["tp"] > 2 * growth["tsp"]
    # weights: replicated in dp and sp -> larger than tsp already at the short length
    assert peaks["sp-256"] > 1.5 * peaks["tsp-256"] and peaks["dp-256"] > 3 * peaks["tsp-256"]


def test_overlap_costs_at_most_one_weight_shard(peaks):
    """Prefetching keeps the next shard in flight: at most one extra shard alive."""
    from tspbench.core.config import get_config

    cfg, D = get_config("tiny"), 4
    attn = (2 * cfg.heads + 2 * cfg.kv_heads) * cfg.d_head // D * cfg.hidden * 4
    mlp = 3 * cfg.ffn // D * cfg.hidden * 4
    on, off = peaks["tsp-2048"], peaks["tsp-2048-overlap0"]
    assert on <= off + max(attn, mlp)


def test_recompute_lowers_every_strategys_peak(peaks, report):
    rows = [f"{'strategy':10s}     none     full"]
    for s in SIX:
        none, full = peaks[f"{s}-2048"], peaks[f"{s}-2048-recompute"]
        rows.append(f"{s:10s}{mib(none)} {mib(full)}")
        assert full < none, s
    report("Peak live MiB per rank at D=4, S=2048, by --recompute", "\n".join(rows))
