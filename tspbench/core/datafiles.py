"""Files shipped inside the package (schemas, the paper's claims, hardware presets), found through
importlib.resources: an installed wheel has no repository around it to read them from.

A schema takes the strategy names from the registry where it says ``{x-enum: strategies}``:
hand-copied lists drifted from the code; and an object marked ``{x-options: properties}`` takes
one property per strategy option (each strategy's own, tspbench/core/options.py). The registry
sits above core, so callers pass both (``tspbench.runtime.registry.schema`` does)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

MARK = "x-enum"  # JSON Schema ignores x- keywords: a schema read raw just lacks the enum
OPTIONS = "x-options"  # ... and the options' properties
Options = tuple[tuple[str, dict[str, Any]], ...]  # (name, its values' schema) per option


def path(name: str) -> Path:
    """A packaged file by its path inside tspbench (``schemas/plan.schema.yaml``); the wheel
    installs them as plain files, so tools that want a path (snakemake's validate) get one."""
    return Path(str(resources.files("tspbench").joinpath(name)))


def read_text(name: str) -> str:
    """The text of a packaged file (see :func:`path`)."""
    return resources.files("tspbench").joinpath(name).read_text(encoding="utf-8")


def schema(name: str, strategies: tuple[str, ...] = (), options: Options = ()) -> dict[str, Any]:
    """``tspbench/schemas/<name>`` (JSON or YAML) with ``strategies`` as the enum at each
    ``{x-enum: strategies}`` and ``options`` among the properties where ``{x-options:
    properties}``; ValueError if the schema is marked and they were not given."""
    text = read_text(f"schemas/{name}")
    spec = json.loads(text) if name.endswith(".json") else yaml.safe_load(text)
    _fill(spec, name, strategies, options)
    return spec


def _fill(node: Any, name: str, strategies: tuple[str, ...], options: Options) -> None:
    if isinstance(node, list):
        for v in node:
            _fill(v, name, strategies, options)
    if not isinstance(node, dict):
        return
    if OPTIONS in node:
        if node[OPTIONS] != "properties" or not options:
            raise ValueError(f"schema {name}: {OPTIONS}: {node[OPTIONS]!r} needs the options")
        del node[OPTIONS]
        node["properties"].update(dict(options))
    if MARK in node:
        if node[MARK] != "strategies" or not strategies:
            raise ValueError(f"schema {name}: {MARK}: {node[MARK]!r} needs the strategy names")
        del node[MARK]
        node["enum"] = list(strategies)
    for v in node.values():
        _fill(v, name, strategies, options)
