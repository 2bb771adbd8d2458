"""The design-choice note of the subject's memory rows in ``tspbench claims``: what an option of
the subject's (named by the claims file, never by the code) and the online loss save."""

from __future__ import annotations

from tspbench.core.config import ModelConfig
from tspbench.projection import analytic
from tspbench.runtime.registry import all_options, get_strategy
from tspbench.runtime.spec import RunSpec

GB = 1e9


def _has_choice(c: dict) -> bool:
    """The subject's row, when the subject declares the claims' design-choice option."""
    choice, subject = c.get("design_choice"), c["subject"]
    declared = {o.name for o in get_strategy(subject).options}
    return c["strategy"] == subject and bool(choice and choice["option"] in declared)


def design_note(cfg: ModelConfig, c: dict, D: int = 8) -> str:
    """What two design choices of ours save at length S (bytes per GPU), for the subject's
    memory rows (else nothing): the claims' design choice (data: both its values implemented,
    the analytic peaks of the two, bf16), and the online log-sum-exp loss instead of
    materialising a [S/D, V] fp32 logits shard."""
    if not _has_choice(c):
        return ""
    S, choice = c["seq_len"], c["design_choice"]
    ours, other = choice["ours"], choice["other"]
    option = choice["option"]
    peaks = {
        (rc, v): analytic.memory(
            RunSpec.make(
                c["subject"], cfg, degree=D, seq_len=S, dtype="bf16", recompute=rc, **{option: v}
            )
        )["peak"]
        for rc in ("none", "full")
        for v in (ours, other)
    }
    both = [
        f"{peaks[rc, ours] / GB:.1f} -> {peaks[rc, other] / GB:.1f} GB "
        f"(+{(peaks[rc, other] - peaks[rc, ours]) / GB:.1f}) {how}"
        for rc, how in (("none", "without recompute"), ("full", "with it"))
    ]
    logits = S // D * cfg.vocab * 4
    flag = all_options()[option].flag
    return (
        f" Our design choices, at S = {S}: {choice['what']} ({flag} {other}, implemented and "
        f"tested) {choice['effect']}: analytic peak {both[0]}, {both[1]}; a "
        f"loss that materialises its logits would add {logits / GB:.1f} GB."
    )
