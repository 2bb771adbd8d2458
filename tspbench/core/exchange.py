"""The K/V exchange's rules, shared by the strategies that shard the sequence and by the
analytic model: which ``cp_comm``/``cp_a2a`` fit a model over a number of ranks, and which the
planner tries. Pure config logic, below both :mod:`tspbench.core.costs` and
:mod:`tspbench.core.context_parallel` (which builds the groups), so neither imports the other."""

from __future__ import annotations

from tspbench.core import zigzag
from tspbench.core.config import ConfigError, ModelConfig
from tspbench.core.options import CP_A2A, Value


def check_exchange(
    cfg: ModelConfig, seq_len: int, ranks: int, cp_comm: object, tp: int = 1, cp_a2a: object = 0
) -> None:
    """Refuse, in one line, a sequence the zigzag chunks cannot split over ``ranks``, or, for
    ``cp_comm=a2a``, heads the all-to-all cannot split over them: the heads a rank applies,
    1/``tp`` of them under tensor parallelism (SP, FSDP+CP: all; TP+SP: H/T); for
    ``a2a+p2p``, an inner group size that does not fit (:func:`inner_size`)."""
    zigzag.check_divisible(seq_len, ranks)
    if cp_a2a and cp_comm != "a2a+p2p":
        raise ConfigError(f"cp_a2a={cp_a2a}: only with cp_comm=a2a+p2p (not {cp_comm})")
    if cp_comm == "a2a+p2p" and (ranks > 1 or cp_a2a):  # (a size named over one rank: none
        inner_size(cfg, ranks, tp, int(cp_a2a))  # type: ignore[call-overload]  # fits it)
    if cp_comm != "a2a" or ranks == 1:
        return
    for field in ("heads", "kv_heads"):
        value = getattr(cfg, field)
        if tp == 1 and value % ranks:
            raise ConfigError(
                f"model.{field}={value}: must be divisible by D={ranks} for cp_comm=a2a (the "
                "all-to-all gives each rank H/D query and kv heads)"
            )
        if (value // tp) % ranks:
            raise ConfigError(
                f"model.{field}={value}: {field}/T = {value // tp} must be divisible by "
                f"sp={ranks} for cp_comm=a2a (the all-to-all splits a TP rank's heads over Sigma)"
            )


def a2a_sizes(cfg: ModelConfig, ranks: int, tp: int = 1) -> tuple[int, ...]:
    """Inner group sizes a2a+p2p can use over ``ranks``: a divides them, below them (a ring of
    at least two groups), and divides the query and kv heads a rank applies (H/T)."""
    heads, kv = cfg.heads // tp, cfg.kv_heads // tp
    return tuple(a for a in range(2, ranks) if ranks % a == 0 and heads % a == 0 and kv % a == 0)


def inner_size(cfg: ModelConfig, ranks: int, tp: int, cp_a2a: int) -> int:
    """a2a+p2p's inner group over ``ranks``: ``cp_a2a``, or (0) the largest of
    :func:`a2a_sizes`; ConfigError naming the field where none fits."""
    sizes = a2a_sizes(cfg, ranks, tp)
    rule = (
        f"must divide the context-parallel degree {ranks}, be between 2 and {ranks // 2} (a "
        f"ring of at least two groups) and divide heads/T = {cfg.heads // tp} and kv_heads/T "
        f"= {cfg.kv_heads // tp} (cp_comm=a2a+p2p)"
    )
    if cp_a2a == 0 and not sizes:
        raise ConfigError(f"cp_a2a=0 (the largest that fits): none does; the inner size {rule}")
    if cp_a2a and cp_a2a not in sizes:
        raise ConfigError(f"cp_a2a={cp_a2a}: {rule}")
    return cp_a2a or max(sizes)


def searched_exchange(
    values: dict[str, tuple[Value, ...]], cfg: ModelConfig, ranks: int, tp: int = 1
) -> dict[str, tuple[Value, ...]]:
    """The planner's ``values`` with a2a+p2p's inner sizes over ``ranks`` (each that fits:
    which is best depends on the links each stays on); where none does, the default, which the
    run then refuses, saying why (the plan's ``filtered:`` lines)."""
    return {**values, CP_A2A.name: a2a_sizes(cfg, ranks, tp) or (CP_A2A.default,)}
