"""The data files the package reads ship inside it (tspbench/schemas, tspbench/data), and the
schemas take their strategy names from the registry: no schema carries a copy of the list."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tspbench.core import datafiles
from tspbench.runtime.registry import names, schema, strategies

# each schema, and where it names a strategy (marked there; the registry's names once loaded)
MARKED = {
    "record.schema.json": "properties.strategy",
    "config.schema.yaml": "properties.sweeps.items.properties.strategies.items",
    "projected.schema.yaml": "$defs.strategies.items",
    "claims.schema.yaml": "$defs.strategy",
    "plan.schema.yaml": "properties.focus",
}


@pytest.mark.parametrize("name", sorted(MARKED))
def test_a_schema_takes_the_registry_names_where_marked(name):
    node = functools.reduce(dict.__getitem__, MARKED[name].split("."), schema(name))
    assert node["enum"] == list(strategies())
    raw = datafiles.read_text(f"schemas/{name}")
    assert datafiles.MARK in raw
    # a hand-copied list would name every strategy in one enum; a subset (decode's) may stay
    for line in raw.splitlines():
        assert not all(n in line for n in names()), f"{name}: a copied strategy list: {line}"


def test_a_marked_schema_without_the_names_is_an_error():
    with pytest.raises(ValueError, match="needs the strategy names"):
        datafiles.schema("plan.schema.yaml")
    assert datafiles.schema("regress.schema.yaml")["required"] == ["exact", "relative"]  # unmarked


def test_the_record_schema_takes_every_strategy_option():
    """A record states every strategy's options (an unused one at its default): the schema's
    properties come from the declarations (tspbench/core/options.py), none copied into it."""
    from tspbench.runtime.registry import all_options

    props = schema("record.schema.json")["properties"]
    raw = datafiles.read_text("schemas/record.schema.json")
    for name in all_options():
        assert name in props and f'"{name}"' not in raw, name
    assert props["mlp_schedule"]["enum"] == ["ring", "broadcast"]
    assert props["overlap"]["type"] == "boolean" and props["kv_bucket"]["minimum"] == 0
    with pytest.raises(ValueError, match="needs the options"):
        datafiles.schema("record.schema.json", names())


def test_the_packaged_files_lie_inside_the_package():
    import tspbench

    pkg = Path(tspbench.__file__).parent
    for name in ("schemas/config.schema.yaml", "data/claims.yaml", "projection/hardware.json"):
        assert datafiles.path(name).is_file() and datafiles.path(name).is_relative_to(pkg)
