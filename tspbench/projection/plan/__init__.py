"""The planner (``tspbench plan``, ``plan-map``, ``plan-check``; docs/planning.md), PROJECTED
throughout: :mod:`.search` enumerates and ranks (:func:`plan`), :mod:`.types` holds the request
and the records it fills, :mod:`.cache` the on-disk operation counts and estimates,
:mod:`.render` the text and JSON answers, :mod:`.launch` the run, srun and sweep-config lines;
:mod:`.map` reads the map config and plans its cells, :mod:`.figures` draws them, :mod:`.check`
writes the check.

The entry points are here; the answers' wording and the check are their modules'
(``render.render``, ``render.to_json``, ``check.check``: a function of that name here would hide
its module).
"""

from tspbench.projection.plan.cache import OpsCache, cache_dir
from tspbench.projection.plan.figures import write_map
from tspbench.projection.plan.launch import pipeline_config
from tspbench.projection.plan.map import load_config, sweep
from tspbench.projection.plan.search import peak_of, plan
from tspbench.projection.plan.types import Plan, Request

__all__ = [
    "OpsCache",
    "Plan",
    "Request",
    "cache_dir",
    "load_config",
    "peak_of",
    "pipeline_config",
    "plan",
    "sweep",
    "write_map",
]
