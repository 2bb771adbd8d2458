"""A named device mesh over the default process group, one counted :class:`Comm` per axis.

Ranks are laid out row-major over the axes in the order given (outermost first), so the last
axes hold contiguous ranks: put the model-parallel axes last to keep a model group in one node.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

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
    PP = "pp"  # pipeline stages (outermost: it crosses nodes, the model groups stay inside)

    __repr__ = str.__repr__


@dataclass
class Mesh:
    dims: dict[str, int]
    comms: dict[str, Comm]
    counter: CommCounter
    lines: dict[str, list[list[int]]]  # every group of each axis (global ranks)
    splits: dict[tuple[str, int], tuple[Comm, Comm]] = field(default_factory=dict)  # split()'s
    end_pairs: dict[str, Comm] = field(default_factory=dict)  # ends()'s, by axis

    def __getitem__(self, axis: str) -> Comm:
        return self.comms[axis]

    def size(self, axis: str) -> int:
        return self.dims[axis]

    def split(self, axis: str, inner: int) -> tuple[Comm, Comm]:
        """(inner, outer) groups of ``axis``: its ``inner`` consecutive ranks (a node's share of
        the axis), and the ranks at the same place in each inner group, across them. Counted as
        ``<axis>.a2a`` and ``<axis>.p2p`` (:meth:`CommCounter.by_kind` takes them as
        ``axis``'s) and kept among the mesh's comms under those names, so that whatever walks
        them (``tspbench overlap``'s trace, replay and skip) sees them; made once per mesh and
        size (a test's mesh serves cases of several sizes).
        Collective: every rank must call it with the same arguments."""
        names = (f"{axis}.a2a", f"{axis}.p2p")
        if (axis, inner) not in self.splits:
            inner_lines, outer_lines = split_lines(self.lines[axis], inner)
            self.splits[(axis, inner)] = (
                _comm(inner_lines, names[0], self.counter),
                _comm(outer_lines, names[1], self.counter),
            )
        pair = self.splits[(axis, inner)]
        self.comms.update(zip(names, pair))  # the latest split (one per run)
        return pair

    def ends(self, axis: str) -> Comm:
        """The first and the last rank of each line of ``axis`` in one group (the others
        alone), counted as ``axis``: a pipeline's two copies of a tied embedding, on its first
        and last stage. Made once per mesh. Collective: every rank must call it."""
        if axis not in self.end_pairs:
            lines = [sorted({ln[0], ln[-1]}) for ln in self.lines[axis]]
            lines += [[r] for ln in self.lines[axis] for r in ln[1:-1]]
            self.end_pairs[axis] = _comm(lines, axis, self.counter)
        return self.end_pairs[axis]


def split_lines(lines: list[list[int]], inner: int) -> tuple[list[list[int]], list[list[int]]]:
    """(inner, outer) groups of an axis's ``lines``: each line's runs of ``inner`` consecutive
    ranks, and the ranks at the same place in each run."""
    size = len(lines[0])
    if inner < 1 or size % inner:
        raise ValueError(f"groups of {size} ranks: no inner groups of {inner}")
    inner_lines = [ln[j : j + inner] for ln in lines for j in range(0, size, inner)]
    outer_lines = [ln[j::inner] for ln in lines for j in range(inner)]
    return inner_lines, outer_lines


def rank_grid(dims: dict[str, int]) -> torch.Tensor:
    """Global ranks laid out over the mesh axes (row-major)."""
    return torch.arange(math.prod(dims.values())).reshape(tuple(dims.values()) or (1,))


def build_mesh(dims: dict[str, int], counter: CommCounter | None = None) -> Mesh:
    """Create one process group per mesh line (collective: every rank must call it)."""
    counter = counter or CommCounter()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if math.prod(dims.values()) != world:
        raise ValueError(f"mesh {dims} has {math.prod(dims.values())} ranks, world has {world}")
    grid = rank_grid(dims)
    lines = {
        axis: grid.movedim(i, -1).reshape(-1, size).tolist()
        for i, (axis, size) in enumerate(dims.items())
    }
    comms = {axis: _comm(lines[axis], axis, counter) for axis in dims}
    return Mesh(dict(dims), comms, counter, lines)


def _comm(lines: list[list[int]], axis: str, counter: CommCounter) -> Comm:
    """This rank's :class:`Comm` among ``lines`` (disjoint groups covering the world; one
    process group each, made by every rank)."""
    me = dist.get_rank() if dist.is_initialized() else 0
    mine = next(line for line in lines if me in line)
    if all(len(line) == 1 for line in lines):
        return Comm(None, mine, axis, counter)
    group, _ = dist.new_subgroups_by_enumeration(lines)
    return Comm(group if len(mine) > 1 else None, mine, axis, counter)
