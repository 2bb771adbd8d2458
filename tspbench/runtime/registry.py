"""Strategy registry: the harness's one place that knows every strategy by name."""

from __future__ import annotations

from typing import Any

from tspbench.core import datafiles
from tspbench.core.config import ConfigError
from tspbench.core.strategy import Strategy


def strategies() -> dict[str, type[Strategy]]:
    """Every strategy by name, in the order tables and figures show them (TSP first)."""
    from baselines.dp import DP, Single
    from baselines.fsdp_cp import FSDPCP
    from baselines.sp import SP
    from baselines.tp import TP
    from baselines.tpsp import TPSP
    from tsp_impl import TSP

    return {s.name: s for s in (TSP, TP, TPSP, SP, FSDPCP, DP, Single)}


def get_strategy(name: str) -> type[Strategy]:
    known = strategies()
    if name not in known:
        raise ConfigError(f"strategy={name!r}: unknown; known: {', '.join(known)}")
    return known[name]


def reference_name() -> str:
    """The single-device reference strategy's name (the one every other is checked on)."""
    return next(n for n, s in strategies().items() if s.reference)


def names() -> tuple[str, ...]:
    """Every strategy's name, in registry order: the enum each schema's ``x-enum`` mark takes."""
    return tuple(strategies())


def schema(name: str) -> dict[str, Any]:
    """A packaged schema with the registry's strategy names filled in (core.datafiles)."""
    return datafiles.schema(name, names())
