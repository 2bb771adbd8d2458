"""Settings files, read safely and checked against their schema (sweep configs, projection
and plan configs, regression tolerances, run records): YAML without aliases, strict integers,
finite numbers, and one-line ConfigErrors naming the field, the value and the rule."""

from __future__ import annotations

import functools
import json
import math
from collections import deque
from pathlib import Path
from typing import Any

import yaml

from tspbench.core import datafiles
from tspbench.core.config import ConfigError, read_input

MAX_YAML_BYTES = 2**20  # configs and tolerances are a few kB


class _NoAliasLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases: nine nested aliases ("billion laughs") make a tiny file
    whose object is shared references, and anything that walks or prints it runs out of memory."""

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ConfigError(
                f"line {event.start_mark.line + 1}: YAML alias *{event.anchor}: aliases are not "
                f"allowed (write the value out)"
            )
        return super().compose_node(parent, index)


def read_yaml(path: str | Path, what: str) -> Any:
    """The YAML document at ``path``, parsed without aliases; ConfigError (one line) if the file
    cannot be read or is not YAML."""
    text = read_input(path, what, MAX_YAML_BYTES)
    try:
        return yaml.load(text, Loader=_NoAliasLoader)
    except ConfigError as e:
        raise ConfigError(f"{what} {str(path)!r}: {e}") from None
    except (yaml.YAMLError, RecursionError) as e:
        text = str(e).replace("\n", " ")
        raise ConfigError(f"{what} {str(path)!r}: not valid YAML ({text})") from None


def non_finite(obj: object) -> tuple[str, float] | None:
    """(dotted path, value) of the first NaN or infinity in ``obj``: JSON Schema bounds never
    refuse NaN (every comparison with it is false), so a NaN timeout passes ``minimum``.

    A list or mapping met twice is a YAML alias that reached us already parsed (snakemake loads
    ``--configfile`` itself): a ConfigError, before anything walks it exponentially often.
    """
    queue: deque[tuple[str, object]] = deque([("", obj)])  # breadth first: the shortest path
    seen: set[int] = set()
    while queue:
        where, v = queue.popleft()
        if isinstance(v, float) and not math.isfinite(v):
            return where or "(top level)", v
        if not isinstance(v, (dict, list)):
            continue
        if id(v) in seen:
            raise ConfigError(f"{where}: a value used twice (a YAML alias?): write it out")
        seen.add(id(v))
        items = v.items() if isinstance(v, dict) else enumerate(v)
        queue.extend((f"{where}.{k}" if where else str(k), x) for k, x in items)
    return None


@functools.cache
def _validator(schema: str, strategies: tuple[str, ...], options: str) -> Any:
    """The packaged ``schema``'s validator, with integers that are ints: JSON Schema counts 2.0
    as an integer, and the CLI refuses "2.0" (cached: aggregate checks every record of a sweep;
    ``options``: their schemas as JSON, hashable)."""
    import jsonschema

    spec = datafiles.schema(schema, strategies, tuple(json.loads(options).items()))
    base = jsonschema.validators.validator_for(spec)
    strict = base.TYPE_CHECKER.redefine(
        "integer", lambda _, v: isinstance(v, int) and not isinstance(v, bool)
    )
    return jsonschema.validators.extend(base, type_checker=strict)(spec)


def check_schema(
    obj: object,
    schema: str,
    what: str,
    finite: bool = True,
    strategies: tuple[str, ...] = (),
    options: datafiles.Options = (),
) -> None:
    """Validate ``obj`` against the packaged ``schema`` (its strategy enums ``strategies``, its
    option properties ``options``; strict integers; with ``finite``, no NaN or infinity
    anywhere); ConfigError naming the field, the value and the rule, on one line."""
    import jsonschema

    try:
        bad = non_finite(obj)
    except ConfigError as e:
        raise ConfigError(f"{what}: {e}") from None
    if finite and bad:
        raise ConfigError(f"{what}: {bad[0]}: {bad[1]!r} is not a finite number")
    validator = _validator(schema, strategies, json.dumps(dict(options)))
    error = jsonschema.exceptions.best_match(validator.iter_errors(obj))
    if error is not None:
        where = ".".join(map(str, error.absolute_path)) or "(top level)"
        message = error.message  # the value's repr, then the rule: keep both ends of a long one
        message = message if len(message) <= 300 else f"{message[:200]} ... {message[-100:]}"
        raise ConfigError(f"{what}: {where}: {message}")
