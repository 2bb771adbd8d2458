"""Which global ranks form each model group and each data-parallel group, and on which node.

Ranks are laid out row-major over the strategy's mesh axes with ``dp`` outermost, so a model
group is a run of contiguous ranks. Launchers number ranks node by node (torchrun, srun's block
distribution, mpiexec's default), so a model group of D <= GPUs-per-node ranks stays inside one
node exactly when GPUs-per-node is a multiple of D; otherwise some group spans two nodes and its
every collective crosses the network. ``tspbench layout`` lists this without running anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tspbench.core.mesh import Axis, rank_grid
from tspbench.core.strategy import Layout
from tspbench.runtime.registry import get_strategy


@dataclass
class RankLayout:
    axes: dict[str, int]
    model_groups: list[list[int]]
    dp_groups: list[list[int]]
    pp_groups: list[list[int]] = field(default_factory=list)  # stages' peers (pp > 1 only)

    def node_of(self, rank: int, ranks_per_node: int) -> int:
        return rank // ranks_per_node

    def crossing(self, ranks_per_node: int) -> list[list[int]]:
        """Model groups whose ranks sit on more than one node."""
        return [
            g for g in self.model_groups if len({self.node_of(r, ranks_per_node) for r in g}) > 1
        ]

    def as_dict(self) -> dict:
        out = {"axes": self.axes, "model_groups": self.model_groups, "dp_groups": self.dp_groups}
        return {**out, "pp_groups": self.pp_groups} if self.pp_groups else out

    def pp_crossing(self, ranks_per_node: int) -> bool:
        """Whether the pipeline's point-to-point sends cross nodes (they should: the stages go
        across nodes, the model groups inside them)."""
        return any(len({self.node_of(r, ranks_per_node) for r in g}) > 1 for g in self.pp_groups)


def rank_layout(strategy: str, layout: Layout) -> RankLayout:
    dims = get_strategy(strategy).mesh_dims(layout)
    if layout.pp > 1:  # the stages outside the strategy's axes: each holds whole groups
        dims = {Axis.PP: layout.pp, **dims}
    grid = rank_grid(dims).reshape(layout.pp, layout.dp, -1)  # pp, then dp, outermost
    dp_groups = [g for stage in grid for g in stage.T.tolist()]
    pp_groups = grid.reshape(layout.pp, -1).T.tolist() if layout.pp > 1 else []
    models = grid.reshape(layout.pp * layout.dp, -1).tolist()
    return RankLayout(dims, models, dp_groups, pp_groups)


def world_layout(
    strategy: str, world: int, degree: int | None, tp: int = 1, sp: int = 1, pp: int = 1
) -> RankLayout:
    """The groups of ``world`` ranks running ``strategy`` with model groups of ``degree`` in
    ``pp`` pipeline stages (ConfigError if the world does not hold whole groups in every stage
    or the group is not T x Sigma)."""
    from dataclasses import replace

    from tspbench.core.config import ConfigError

    impl = get_strategy(strategy)
    layout = impl.make_layout(degree, tp, sp, 1)
    if pp > 1 and not impl.stages:
        raise ConfigError(f"pp={pp}: strategy {strategy} does not run as a pipeline stage yet")
    if world % (layout.degree * pp):
        raise ConfigError(
            f"--world={world}: must be a multiple of the model group ({layout.degree}) x pp ({pp})"
        )
    factors = impl.factors(layout)
    tp_f, sp_f = factors["tp"], factors["sp"]
    if tp_f is not None and sp_f is not None and tp_f * sp_f != layout.degree:
        raise ConfigError(f"tp={tp} x sp={sp}: must equal degree={layout.degree}")
    return rank_layout(strategy, replace(layout, dp=world // (layout.degree * pp), pp=pp))


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
    pp = len(lay.pp_groups[0]) if lay.pp_groups else 1
    stages = f"pp {pp} x " if pp > 1 else ""
    head = [
        f"world {world} = {stages}dp {len(lay.model_groups) // pp} x model group "
        f"{len(lay.model_groups[0])} (axes {lay.axes}); {ranks_per_node} ranks per node, "
        f"{n_nodes} node(s)"
    ]
    if pp > 1:
        links = "cross nodes" if lay.pp_crossing(ranks_per_node) else "stay inside one node"
        head.append(f"pipeline: stage s's ranks send to stage s+1's; its sends {links}")
    bad = lay.crossing(ranks_per_node)
    flag = [f"WARNING: {len(bad)} model group(s) span nodes: their collectives cross the network"]
    return "\n".join(
        head
        + rows(lay.model_groups, "model")
        + rows(lay.dp_groups, "dp")
        + rows(lay.pp_groups, "pp")
        + (flag if bad else ["every model group stays inside one node"])
    )
