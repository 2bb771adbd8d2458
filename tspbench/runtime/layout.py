"""Which global ranks form each model group and each data-parallel group, and on which node.

Ranks are laid out row-major over the strategy's mesh axes with ``dp`` outermost, so a model
group is a run of contiguous ranks. Launchers number ranks node by node (torchrun, srun's block
distribution, mpiexec's default), so a model group of D <= GPUs-per-node ranks stays inside one
node exactly when GPUs-per-node is a multiple of D; otherwise some group spans two nodes and its
every collective crosses the network. ``tspbench layout`` lists this without running anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from tspbench.core.mesh import rank_grid
from tspbench.core.strategy import Layout
from tspbench.runtime.registry import get_strategy


@dataclass
class RankLayout:
    axes: dict[str, int]
    model_groups: list[list[int]]
    dp_groups: list[list[int]]

    def node_of(self, rank: int, ranks_per_node: int) -> int:
        return rank // ranks_per_node

    def crossing(self, ranks_per_node: int) -> list[list[int]]:
        """Model groups whose ranks sit on more than one node."""
        return [
            g for g in self.model_groups if len({self.node_of(r, ranks_per_node) for r in g}) > 1
        ]

    def as_dict(self) -> dict:
        return {"axes": self.axes, "model_groups": self.model_groups, "dp_groups": self.dp_groups}


def rank_layout(strategy: str, layout: Layout) -> RankLayout:
    dims = get_strategy(strategy).mesh_dims(layout)
    grid = rank_grid(dims).reshape(layout.dp, -1)  # dp is the outermost axis
    return RankLayout(dims, grid.tolist(), grid.T.tolist())


def world_layout(
    strategy: str, world: int, degree: int | None, tp: int = 1, sp: int = 1
) -> RankLayout:
    """The groups of ``world`` ranks running ``strategy`` with model groups of ``degree``
    (ConfigError if the world does not hold whole groups or the group is not T x Sigma)."""
    from dataclasses import replace

    from tspbench.core.config import ConfigError

    impl = get_strategy(strategy)
    layout = impl.make_layout(degree, tp, sp, 1)
    if world % layout.degree:
        raise ConfigError(
            f"--world={world}: must be a multiple of the model group ({layout.degree})"
        )
    factors = impl.factors(layout)
    tp_f, sp_f = factors["tp"], factors["sp"]
    if tp_f is not None and sp_f is not None and tp_f * sp_f != layout.degree:
        raise ConfigError(f"tp={tp} x sp={sp}: must equal degree={layout.degree}")
    return rank_layout(strategy, replace(layout, dp=world // layout.degree))


def _span(ranks: list[int]) -> str:
    """'0-7', '0,8,...,1016 (step 8)' or an explicit list."""
    if len(ranks) > 2:
        step = ranks[1] - ranks[0]
        if step > 0 and ranks == list(range(ranks[0], ranks[-1] + 1, step)):
            return f"{ranks[0]}-{ranks[-1]}" if step == 1 else f"{ranks[0]}-{ranks[-1]} step {step}"
    return ",".join(map(str, ranks))


def describe(lay: RankLayout, ranks_per_node: int, limit: int = 4) -> str:
    """Human-readable listing (first and last groups of each kind when there are many)."""

    def rows(groups: list[list[int]], kind: str) -> list[str]:
        out = []
        shown: list[list[int] | None] = [*groups]
        if len(groups) > 2 * limit:
            shown = [*groups[:limit], None, *groups[-limit:]]
        for i, g in enumerate(shown):
            if g is None:
                out.append(f"  ... {len(groups) - 2 * limit} more {kind} groups")
                continue
            idx = i if i < limit or len(groups) <= 2 * limit else len(groups) - (len(shown) - i)
            nodes = sorted({lay.node_of(r, ranks_per_node) for r in g})
            where = ("nodes " if len(nodes) > 1 else "node ") + _span(nodes)
            out.append(f"  {kind} group {idx}: ranks {_span(g)}  ({where})")
        return out

    world = sum(len(g) for g in lay.model_groups)
    n_nodes = -(-world // ranks_per_node)
    head = [
        f"world {world} = dp {len(lay.model_groups)} x model group {len(lay.model_groups[0])}"
        f" (axes {lay.axes}); {ranks_per_node} ranks per node, {n_nodes} node(s)"
    ]
    bad = lay.crossing(ranks_per_node)
    flag = [f"WARNING: {len(bad)} model group(s) span nodes: their collectives cross the network"]
    return "\n".join(
        head
        + rows(lay.model_groups, "model")
        + rows(lay.dp_groups, "dp")
        + (flag if bad else ["every model group stays inside one node"])
    )
