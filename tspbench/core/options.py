"""The settings a strategy declares for itself (:class:`Option`) and a run's values of them
(:class:`Options`).

A strategy's own knobs (TSP's MLP schedule, say) are declared on its class, so the harness (the
command line, the run's spec and record, the sweep schema, the planner, ids and labels) lists
them without naming any: a new strategy's options need no edit outside its folder.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from tspbench.core.config import ConfigError

Value = bool | int | str


@dataclass(frozen=True)
class Option:
    """One setting of a strategy: its name (``--head-split`` on the command line, ``head_split``
    in the record and the sweep config), its values, its default and what the planner tries."""

    name: str
    default: Value
    help: str
    choices: tuple[Value, ...] = ()  # a str option's values (a bool takes on/off, an int bounds)
    bounds: tuple[int, int] = (0, 0)  # an int option's inclusive range
    searched: bool = False  # the planner tries each value (Strategy.searched_values)
    tag: str = ""  # cell-id suffix where the value is not the default ("{value}": the value);
    # every option needs one, so that two cells that differ only in it never share an id
    label: str = ""  # label suffix likewise, e.g. " ({value} MLP)"
    short: str = ""  # its column in the plan's table
    note: str = ""  # under the plan's table where a candidate is not at the default
    bounded_by_default: bool = False  # its default issues no more operations than any value
    # (the planner bounds an uncounted value's dispatch by its counted default twin)
    only_with: tuple[str, Value] | None = None  # (option, value) it matters under; elsewhere
    # the planner and the projected report use its default only (:func:`only_where_used`)
    pipelines_only: bool = False  # it matters only in a pipeline stage (layout.pp > 1): set
    # elsewhere it is refused, the planner tries its default only and the shared tests skip it
    experts_only: bool = False  # likewise, only for a model with experts (tspbench/core/moe.py)

    def applies(self, pp: int, experts: bool = False) -> bool:
        """Whether a value of it can change a run of ``pp`` pipeline stages of a model with or
        without ``experts`` (one of pipelines only cannot without stages, one of experts only
        not on a dense model: the one place those rules live)."""
        return (pp > 1 or not self.pipelines_only) and (experts or not self.experts_only)

    def why_not(self, pp: int, experts: bool) -> str:
        """Why it cannot apply (``applies`` is False): the rule a set value breaks."""
        if pp <= 1 and self.pipelines_only:
            return f"only with pp > 1 (got pp={pp})"
        return "only for a model with experts (model.experts > 0)"

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def values(self) -> tuple[Value, ...]:
        """Every value it takes where they are few (an int option's: none listed)."""
        return (True, False) if isinstance(self.default, bool) else self.choices

    def check(self, value: object) -> Value:
        """``value`` if this option takes it, else ConfigError naming the option and the rule."""
        if isinstance(self.default, bool):
            ok = isinstance(value, bool)
        elif isinstance(self.default, int):
            lo, hi = self.bounds
            ok = isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi
        else:
            ok = value in self.choices
        if not ok:
            rule = (
                f"must be an integer between {self.bounds[0]} and {self.bounds[1]}"
                if isinstance(self.default, int) and not isinstance(self.default, bool)
                else f"must be one of {', '.join(map(self.text, self.values()))}"
            )
            raise ConfigError(f"{self.name}={value!r}: {rule}")
        return value  # type: ignore[return-value]

    def text(self, value: Value) -> str:
        """The value as the command line spells it (a bool: on, off)."""
        if isinstance(value, bool):
            return "on" if value else "off"
        return str(value)

    def parse(self, text: str) -> Value:
        """The command line's text as a value (ValueError saying what is expected)."""
        if isinstance(self.default, bool):
            if text not in ("on", "off"):
                raise ValueError(f"{text!r}: must be on or off")
            return text == "on"
        if isinstance(self.default, int):
            try:
                value = int(text)
            except ValueError:
                raise ValueError(f"{text!r}: must be an integer") from None
            if not self.bounds[0] <= value <= self.bounds[1]:
                raise ValueError(f"{text!r}: must be between {self.bounds[0]} and {self.bounds[1]}")
            return value
        return text

    def from_cell(self, value: object) -> Value:
        """A value read back from a table's cell (pandas: numpy scalars, a float for an int)."""
        if isinstance(self.default, bool):
            return str(value).lower() in ("true", "on", "1")
        return int(value) if isinstance(self.default, int) else str(value)  # type: ignore[call-overload]

    def schema(self, takers: list[str]) -> dict[str, object]:
        """The JSON Schema of its values, as a record states them (``takers``: the strategies
        that declare it; the others record the default, unused)."""
        about = {"description": f"{', '.join(takers)}: {self.help} (others: unused)"}
        if isinstance(self.default, bool):
            return {"type": "boolean", **about}
        if isinstance(self.default, int):
            lo, hi = self.bounds
            return {"type": "integer", "minimum": lo, "maximum": hi, **about}
        return {"enum": list(self.choices), **about}


# Shared by the strategies that overlap communication with compute (each declares it).
OVERLAP = Option(
    "overlap",
    True,
    "prefetch the next weight shard (unit) and drain gradient reductions while computing "
    "(off: measure it)",
    tag="-overlap-{value}",
    label=" (overlap {value})",
)

# Shared by the strategies that shard the sequence over whole weights (SP, FSDP+CP): how the
# context-parallel ranks exchange what attention needs (tspbench/core/context_parallel.py).
CP_COMM = Option(
    "cp_comm",
    "all_gather",
    "context parallelism's exchange: all_gather K/V along the sequence (reduce-scatter in "
    "backward), or a2a: DeepSpeed-Ulysses all-to-alls of Q, K/V and the output between "
    "sequence and heads (heads and kv_heads divisible by D), or ring: K/V chunks passed "
    "point-to-point round the ring behind each chunk's attention (Megatron-Core's p2p), or "
    "a2a+p2p: an all-to-all inside groups of cp_a2a consecutive ranks (a node's), the ring "
    "across the groups (Megatron-Core's hierarchical exchange)",
    choices=("all_gather", "a2a", "ring", "a2a+p2p"),
    searched=True,  # the planner weighs TSP against the best exchange, not only the all-gather
    tag="-cp-{value}",
    label=" ({value})",
    short="cp",
)


def only_where_used(
    declared: tuple[Option, ...], combos: list[dict[str, Value]]
) -> list[dict[str, Value]]:
    """``combos`` of option values with each option that matters only under another's value
    (``only_with``) set to its default elsewhere, repeats dropped: no run twice."""
    out: list[dict[str, Value]] = []
    for combo in combos:
        combo = dict(combo)
        for o in declared:
            if o.only_with and o.name in combo and combo.get(o.only_with[0]) != o.only_with[1]:
                combo[o.name] = o.default
        if combo not in out:
            out.append(combo)
    return out


def _id_safe(text: str, what: str) -> str:
    """A tag as cell ids take it (letters, digits, ``_.-``: ``a2a+p2p`` is ``a2a_p2p``)."""
    return text.replace("+", "_") if what == "tag" else text


# a2a+p2p's inner group; the planner tries each size that divides the degree and the heads
# (the strategies' searched_values), since which is best depends on the links it stays on
CP_A2A = Option(
    "cp_a2a",
    0,
    "cp_comm=a2a+p2p: ranks of each inner all-to-all group (consecutive ranks; the ring runs "
    "over degree/cp_a2a groups); 0: the largest that divides the context-parallel degree below "
    "it and the heads a rank applies, which knows no node: where the group spans nodes, name "
    "the ranks a node holds of it (the planner tries every size)",
    bounds=(0, 65536),
    searched=True,
    tag="-a2a{value}",
    label=" (a2a over {value})",
    short="a2a",
    only_with=("cp_comm", "a2a+p2p"),
)


class Options(Mapping[str, Value]):
    """A run's values of its strategy's options, in declaration order, every one filled in:
    read-only and hashable (a run's spec is)."""

    def __init__(self, declared: tuple[Option, ...], values: Mapping[str, object], who: str):
        known = {o.name for o in declared}
        for name in values:
            if name not in known:
                takes = ", ".join(sorted(known)) or "none"
                raise ConfigError(
                    f"{name}: strategy {who} takes no such option (its options: {takes})"
                )
        self._declared = declared
        self._items = tuple((o.name, o.check(values.get(o.name, o.default))) for o in declared)

    def suffix(self, what: str) -> str:
        """The ``tag`` or ``label`` suffixes of the values that are not their defaults (a run
        at every default is named as before the options existed)."""
        return "".join(
            _id_safe(getattr(o, what).format(value=o.text(v)), what)
            for o, (_, v) in zip(self._declared, self._items)
            if v != o.default
        )

    def __getitem__(self, name: str) -> Value:
        for k, v in self._items:
            if k == name:
                return v
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        return dict(self) == dict(other) if isinstance(other, Mapping) else NotImplemented

    def __repr__(self) -> str:
        return f"Options({dict(self._items)!r})"
