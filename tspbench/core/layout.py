"""The parallel sizes of a run (its own module: the strategy interface and the closed forms in
tspbench/core/costs.py both take it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """Parallel sizes requested by the user: the model group, data-parallel replicas and
    pipeline stages."""

    degree: int = 1  # D: ranks in one model group
    tp: int = 1  # T (tpsp only)
    sp: int = 1  # Sigma (tpsp only)
    dp: int = 1  # model replicas
    pp: int = 1  # pipeline stages, each a block of layers run by its own D x dp ranks

    @property
    def world_size(self) -> int:
        return self.degree * self.dp * self.pp
