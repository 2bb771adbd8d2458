"""The part of the model one pipeline stage holds: a contiguous block of layers, the embedding
on the first stage, the final norm and the LM head on the last (Megatron-Core's and torchtitan's
split). A strategy built with a :class:`Stage` makes only these parameters, so a stage's weights,
gradients and optimizer state are its own share, as on a real pipeline. With tied embeddings
the last stage holds a copy of the embedding as its head, as Megatron-Core's does: the two
copies start equal, and the runtime sums their gradients after every step
(:class:`tspbench.runtime.pipelined.Pipelined`), so they stay equal."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tspbench.core.config import ConfigError, ModelConfig

_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class Stage:
    index: int  # 0 .. count-1, in the order activations flow
    count: int  # pp
    lo: int  # first layer held
    hi: int  # one past the last layer held
    tied: bool = False  # tied embeddings: the last stage holds the embedding too (its head)

    @classmethod
    def of(cls, cfg: ModelConfig, count: int, index: int) -> Stage:
        """Stage ``index`` of ``count`` equal blocks of ``cfg.layers`` (ConfigError where they
        do not divide)."""
        check(cfg, count)
        per = cfg.layers // count
        return cls(index, count, index * per, (index + 1) * per, cfg.tie_embeddings)

    @classmethod
    def whole(cls, cfg: ModelConfig) -> Stage:
        return cls(0, 1, 0, cfg.layers, cfg.tie_embeddings)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    @property
    def layers(self) -> range:
        return range(self.lo, self.hi)

    def holds(self, name: str) -> bool:
        """Whether the reference parameter ``name`` lives on this stage (with tied embeddings,
        ``embed`` on the first and, as its head, on the last)."""
        m = _LAYER.match(name)
        if m:
            return self.lo <= int(m.group(1)) < self.hi
        if name == "embed":
            return self.first or (self.tied and self.last)
        return self.last

    @property
    def tied_copy(self) -> bool:
        """Whether this stage's embedding is the last stage's copy, the head (tied embeddings,
        not also the first stage)."""
        return self.tied and self.last and not self.first


def check(cfg: ModelConfig, pp: int) -> None:
    """Refuse, in one line, a pipeline the model cannot be split into."""
    if pp == 1:
        return
    if cfg.layers % pp:
        raise ConfigError(
            f"pp={pp}: must divide model.layers={cfg.layers} (each stage holds an equal block "
            "of layers)"
        )
