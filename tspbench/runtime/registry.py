"""Strategy registry: the harness's one place that knows every strategy by name.

A strategy is one folder (docs/adding-a-strategy.md) and one line of :data:`STRATEGIES`:
``"module:Class"``. ``TSPBENCH_STRATEGIES`` (comma-separated, the same form) registers more
without an edit here (a plug-in's, or the tests' toy strategy); spawned ranks inherit it.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

from tspbench.core import datafiles
from tspbench.core.config import ConfigError
from tspbench.core.options import Option
from tspbench.core.strategy import Strategy

# In the order tables and figures show them (TSP first).
STRATEGIES = (
    "tsp_impl:TSP",
    "baselines.tp:TP",
    "baselines.tpsp:TPSP",
    "baselines.sp:SP",
    "baselines.fsdp_cp:FSDPCP",
    "baselines.dp:DP",
    "baselines.dp:Single",
    "baselines.fsdp2_cp:FSDP2CP",
    "baselines.tp_torch:TPTorch",
)
PLUGINS = "TSPBENCH_STRATEGIES"  # environment: more "module:Class" entries, comma-separated


def load(entry: str) -> type[Strategy]:
    """The strategy class of a ``"module:Class"`` entry; ConfigError naming it otherwise."""
    module, _, attr = entry.partition(":")
    try:
        impl = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(
            f"{PLUGINS}={entry!r}: cannot load {attr or '?'} from {module}: {e}"
        ) from e
    if not (isinstance(impl, type) and issubclass(impl, Strategy)):
        raise ConfigError(f"{PLUGINS}={entry!r}: not a tspbench.core.strategy.Strategy")
    return impl


@functools.cache
def _registered(plugins: str) -> dict[str, type[Strategy]]:
    entries = [*STRATEGIES, *(e.strip() for e in plugins.split(",") if e.strip())]
    out: dict[str, type[Strategy]] = {}
    for entry in entries:
        impl = load(entry)
        if out.setdefault(impl.name, impl) is not impl:
            raise ConfigError(f"{entry}: strategy name {impl.name!r} is registered twice")
    return out


def strategies() -> dict[str, type[Strategy]]:
    """Every strategy by name, in the order tables and figures show them (TSP first)."""
    return _registered(os.environ.get(PLUGINS, ""))


def planned() -> dict[str, type[Strategy]]:
    """The strategies the planner weighs: each layout once, not again in another library's code
    (a strategy that ``implements`` another's layout is measured beside it, not planned)."""
    return {n: s for n, s in strategies().items() if s.implements is None}


def get_strategy(name: str) -> type[Strategy]:
    known = strategies()
    if name not in known:
        raise ConfigError(f"strategy={name!r}: unknown; known: {', '.join(known)}")
    return known[name]


def reference_name() -> str:
    """The single-device reference strategy's name (the one every other is checked on)."""
    return next(n for n, s in strategies().items() if s.reference)


def all_options() -> dict[str, Option]:
    """Every strategy's options by name, in registry then declaration order: the command line's
    flags and the record's keys. A name two strategies declare is one option (the same
    :class:`Option`), and each has a tag (two cells that differ only in it would share an id),
    else ConfigError."""
    out: dict[str, Option] = {}
    for name, impl in strategies().items():
        for o in impl.options:
            if out.setdefault(o.name, o) != o or not o.tag:
                raise ConfigError(f"option {o.name} of strategy {name}: declared differently "
                                  "by another strategy, or without a tag")  # fmt: skip
    return out


def searched() -> dict[str, Option]:
    """Every strategy's ``searched`` options in the plan's order: those with listed values, then
    the counted ones (an int range), each group in registry order (the plan table's columns, and
    its enumeration's: the first varies slowest)."""
    opts = [o for o in all_options().values() if o.searched]
    return {o.name: o for o in sorted(opts, key=lambda o: not o.values())}


def preset_chosen() -> list[str]:
    """The options some strategy chooses from a hardware preset (the same for every preset),
    in registry order: what a projection names beside its strategy."""
    return list(dict.fromkeys(k for s in strategies().values() for k in s.preset_options({})))


def takers(option: str) -> list[str]:
    """The strategies that declare ``option``."""
    return [n for n, s in strategies().items() if any(o.name == option for o in s.options)]


def names() -> tuple[str, ...]:
    """Every strategy's name, in registry order: the enum each schema's ``x-enum`` mark takes."""
    return tuple(strategies())


def option_schemas() -> datafiles.Options:
    """Every strategy option's schema, as a record states it (the schemas' ``x-options``)."""
    return tuple((k, o.schema(takers(k))) for k, o in all_options().items())


def schema(name: str) -> dict[str, Any]:
    """A packaged schema with the registry's strategy names and options filled in
    (core.datafiles)."""
    return datafiles.schema(name, names(), option_schemas())
