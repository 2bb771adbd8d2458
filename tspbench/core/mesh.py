"""A named device mesh over the default process group, one counted :class:`Comm` per axis.

Ranks are laid out row-major over the axes in the order given (outermost first), so the last
axes hold contiguous ranks: put the model-parallel axes last to keep a model group in one node.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tspbench.core.comm import Comm, CommCounter


class Axis(enum.StrEnum):
    """Names of the mesh axes. Each member is its string (``Axis.DP == "dp"``, same hash), so
    comparisons, dict keys and JSON written with plain strings keep working; ``repr`` is the
    string's too, so a printed mesh reads exactly as with plain strings."""

    MODEL = "model"  # the D-rank model group (TSP, DP, TP, SP, FSDP+CP)
    DP = "dp"  # data-parallel replicas of the model group
    TP = "tp"  # TP+SP: the T-rank tensor-parallel group (innermost)
    SP = "sp"  # TP+SP: the Sigma-rank context-parallel group

    __repr__ = str.__repr__


@dataclass
class Mesh:
    dims: dict[str, int]
    comms: dict[str, Comm]
    counter: CommCounter

    def __getitem__(self, axis: str) -> Comm:
        return self.comms[axis]

    def size(self, axis: str) -> int:
        return self.dims[axis]


def rank_grid(dims: dict[str, int]) -> torch.Tensor:
    """Global ranks laid out over the mesh axes (row-major)."""
    return torch.arange(math.prod(dims.values())).reshape(tuple(dims.values()) or (1,))


def build_mesh(dims: dict[str, int], counter: CommCounter | None = None) -> Mesh:
    """Create one process group per mesh line (collective: every rank must call it)."""
    counter = counter or CommCounter()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if math.prod(dims.values()) != world:
        raise ValueError(f"mesh {dims} has {math.prod(dims.values())} ranks, world has {world}")
    me = dist.get_rank() if dist.is_initialized() else 0
    grid = rank_grid(dims)
    comms = {}
    for i, (axis, size) in enumerate(dims.items()):
        lines = grid.movedim(i, -1).reshape(-1, size).tolist()
        mine = next(line for line in lines if me in line)
        if size == 1:
            comms[axis] = Comm(None, mine, axis, counter)
            continue
        group, _ = dist.new_subgroups_by_enumeration(lines)
        comms[axis] = Comm(group, mine, axis, counter)
    return Mesh(dict(dims), comms, counter)
