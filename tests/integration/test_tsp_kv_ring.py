"""TSP's K/V ring (``kv_exchange=ring``) where attention is the step's crest: small MLP and
vocabulary, long sequence, so that one head group's gathered K/V decides the all-gather's peak.
On the fake-tensor estimator (equal to measured runs to the byte: test_scale), the ring's peak is
below the all-gather's, and the closed forms (``ring_forward_crest``, ``ring_backward_crest``)
are within 10% of the ring's peak without gloo's staging (what they model), as test_scale holds
every other cell. test_scale's own ring cells crest elsewhere (the MLP, the loss), so they do not
check these forms."""

from __future__ import annotations

import pytest

from tspbench.core.config import get_config
from tspbench.projection import analytic
from tspbench.projection.estimate import estimate_rank
from tspbench.runtime.spec import RunSpec

NARROW = {"ffn": 64, "vocab": 64}  # the MLP and the loss small beside attention at S = 8192
NARROWER = {"ffn": 16, "vocab": 64}  # (training: beside the saved activations too)
CASES = {
    "mha-D2-infer": (NARROW, 2, "infer", "none"),
    "mha-D4-infer": (NARROW, 4, "infer", "none"),
    "gqa-D4-infer": ({**NARROW, "kv_heads": 4}, 4, "infer", "none"),
    "mha-D2-train-full": (NARROWER, 2, "train", "full"),
    "gqa-D2-train-full": ({**NARROWER, "kv_heads": 4}, 2, "train", "full"),
}


def _peaks(model: dict, D: int, mode: str, rc: str, exchange: str) -> tuple[int, int]:
    """(fake-tensor peak without staging, analytic peak) of TSP's first step."""
    spec = RunSpec.make(
        "tsp", get_config("tiny", **model), degree=D, seq_len=8192, batch=1, mode=mode,
        recompute=rc, kv_exchange=exchange, warmup=0, steps=1,
    )  # fmt: skip
    fake = estimate_rank(spec, 0, "cpu_flash")["peak_first_bytes_unstaged"]
    return fake, analytic.memory(spec)["peak_first"]


@pytest.mark.parametrize("name", CASES)
def test_ring_lowers_the_attention_crest_and_the_closed_forms_follow(name, report):
    gather, _ = _peaks(*CASES[name], "all_gather")
    ring, closed = _peaks(*CASES[name], "ring")
    report(
        f"TSP K/V ring, {name} (S = 8192)",
        f"peak all_gather {gather / 2**20:.2f} MiB, ring {ring / 2**20:.2f} MiB "
        f"({ring / gather:.3f}); analytic ring {closed / ring - 1:+.3f}",
    )
    assert ring < 0.95 * gather
    assert abs(closed / ring - 1) <= 0.10
